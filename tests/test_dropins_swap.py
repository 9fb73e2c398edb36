"""swap_rel_pos_attention: matched by full class path, every candidate validated before any is
replaced, count returned."""
import copy

import pytest
import torch
import torch.nn as nn

from txl_kernels.modules import (ESPnetRelPositionMultiHeadedAttention,
                                 NeMoRelPositionMultiHeadAttention, SWAP_TABLE,
                                 swap_rel_pos_attention)
from txl_kernels.modules.swap import class_path

from test_conformer import N_FEAT, N_HEAD, ESPnetOriginal, NeMoOriginal, rnd

NEMO_PATH = "nemo.collections.asr.parts.submodules.multi_head_attention"
ESPNET_PATH = "espnet.nets.pytorch_backend.transformer.attention"


def fake(base, name, module):
    """A class that claims to be ``module.name`` (what the real packages' classes look like)."""
    return type(name, (base,), {"__module__": module, "__qualname__": name})


NeMoFake = fake(NeMoOriginal, "RelPositionMultiHeadAttention", NEMO_PATH)
ESPnetFake = fake(ESPnetOriginal, "RelPositionMultiHeadedAttention", ESPNET_PATH)


class TransducerRelPosMHA(nn.Module):
    """espnet2's transducer attention: same class name as ESPnet's, another API (num_heads, a
    (B, T) True-is-padded mask, chunk_mask / left_context); no ``h`` attribute."""

    def __init__(self, num_heads, embed_size, dropout_rate=0.0):
        super().__init__()
        self.d_k = embed_size // num_heads
        self.num_heads = num_heads
        self.linear_q = nn.Linear(embed_size, embed_size)
        self.linear_k = nn.Linear(embed_size, embed_size)
        self.linear_v = nn.Linear(embed_size, embed_size)
        self.linear_out = nn.Linear(embed_size, embed_size)
        self.linear_pos = nn.Linear(embed_size, embed_size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, query, key, value, pos_enc, mask, chunk_mask=None, left_context=0):
        raise NotImplementedError


Espnet2Transducer = fake(TransducerRelPosMHA, "RelPositionMultiHeadedAttention",
                         "espnet2.asr_transducer.encoder.modules.attention")


def snapshot(model):
    return [(n, type(m), id(m)) for n, m in model.named_modules()]


def test_table_keys_are_full_class_paths():
    assert f"{NEMO_PATH}.RelPositionMultiHeadAttention" in SWAP_TABLE
    assert f"{ESPNET_PATH}.RelPositionMultiHeadedAttention" in SWAP_TABLE
    for path, entry in SWAP_TABLE.items():
        # a short path (a top-level module, like icefall's recipes) must also check the API
        assert path.count(".") >= 2 or entry.accepts is not None, path
        assert hasattr(entry.dropin, "from_module"), path
    esp = ESPnetFake(N_HEAD, N_FEAT, 0.0)
    assert class_path(esp) == f"{ESPNET_PATH}.RelPositionMultiHeadedAttention"


def test_espnet2_transducer_class_is_not_taken_for_espnet():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "enc": nn.ModuleList([ESPnetFake(N_HEAD, N_FEAT, 0.0),
                              NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)]),
        "transducer": Espnet2Transducer(N_HEAD, N_FEAT),
    }).eval()
    before = copy.deepcopy(model)
    transducer = model["transducer"]
    assert swap_rel_pos_attention(model, backend="reference") == 2
    assert isinstance(model["enc"][0], ESPnetRelPositionMultiHeadedAttention)
    assert isinstance(model["enc"][1], NeMoRelPositionMultiHeadAttention)
    assert model["transducer"] is transducer
    B, T = 2, 7
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT, seed=1)
    torch.testing.assert_close(model["enc"][0](x, x, x, pe, None),
                               before["enc"][0](x, x, x, pe, None), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bad", ["missing_attribute", "constructor_rejects"])
def test_invalid_candidate_leaves_model_untouched(bad):
    good_a = ESPnetFake(N_HEAD, N_FEAT, 0.0)
    good_b = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
    broken = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
    if bad == "missing_attribute":
        del broken.h
        err, match = TypeError, r"layers\.1\.attn .*RelPositionMultiHeadAttention.* lacks h"
    else:
        broken.h = 5  # 64 features cannot be split into 5 heads
        err, match = ValueError, r"cannot convert layers\.1\.attn .*n_feat must be"
    layers = [nn.Module(), nn.Module(), nn.Module()]
    for layer, attn in zip(layers, (good_a, broken, good_b)):
        layer.attn = attn
    model = nn.ModuleDict({"layers": nn.ModuleList(layers)})
    before = snapshot(model)
    params = [id(p) for p in model.parameters()]
    with pytest.raises(err, match=match) as info:
        swap_rel_pos_attention(model)
    assert "nothing was replaced" in str(info.value)
    assert snapshot(model) == before
    assert [id(p) for p in model.parameters()] == params


def test_subclass_and_other_packages_not_matched():
    sub = type("RelPositionMultiHeadedAttention", (ESPnetFake,),
               {"__module__": "mypkg.attention"})
    wenet = fake(ESPnetOriginal, "RelPositionMultiHeadedAttention", "wenet.transformer.attention")
    model = nn.Sequential(sub(N_HEAD, N_FEAT, 0.0), wenet(N_HEAD, N_FEAT, 0.0))
    before = snapshot(model)
    assert swap_rel_pos_attention(model) == 0
    assert snapshot(model) == before


def test_shared_module_replaced_once_everywhere():
    shared = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
    a, b = nn.Module(), nn.Module()
    a.attn = b.attn = shared
    model = nn.ModuleList([a, b])
    assert swap_rel_pos_attention(model, backend="reference") == 1
    assert isinstance(a.attn, NeMoRelPositionMultiHeadAttention) and a.attn is b.attn
    assert a.attn.linear_q is shared.linear_q


def test_model_that_is_itself_an_original_is_refused():
    with pytest.raises(ValueError, match="model itself.*from_module"):
        swap_rel_pos_attention(ESPnetFake(N_HEAD, N_FEAT, 0.0))


def _same_parent_layouts():
    """Models that reach one original under several names of one parent (the names
    ``named_children`` yields once)."""
    def two_attrs():
        m = nn.Module()
        m.a = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
        m.b = m.a
        return m, lambda m: [m.a, m.b]

    def sequential():
        x = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
        return nn.Sequential(x, x), lambda m: list(m)

    def module_list():
        layer = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
        return nn.ModuleList([layer] * 3), lambda m: list(m)

    return {"two_attrs": two_attrs, "sequential": sequential, "module_list": module_list}


@pytest.mark.parametrize("layout", sorted(_same_parent_layouts()))
def test_module_under_several_names_of_one_parent_gets_one_dropin(layout):
    model, refs = _same_parent_layouts()[layout]()
    original = refs(model)[0]
    assert swap_rel_pos_attention(model, backend="reference") == 1  # one module swapped
    new = refs(model)
    assert all(isinstance(m, NeMoRelPositionMultiHeadAttention) for m in new), new
    assert all(m is new[0] for m in new)  # the same drop-in: shared weights stay shared
    assert new[0].linear_q is original.linear_q
    assert not any(m is original for m in model.modules())


def test_count_is_of_modules_not_references():
    """Two originals, one of them reached three times: 2 modules swapped."""
    shared = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
    other = NeMoFake(N_HEAD, N_FEAT, 0.0, None, None)
    model = nn.Sequential(shared, other, shared)
    model.extra = shared
    assert swap_rel_pos_attention(model, backend="reference") == 2
    assert model[0] is model[2] is model.extra and model[0] is not model[1]
    assert all(isinstance(m, NeMoRelPositionMultiHeadAttention) for m in model)
