"""GTrXL drop-ins (RLlib RelativeMultiHeadAttention, DI-engine AttentionXL) against
transcriptions of the originals (tests/originals_gtrxl.py), with memory and the originals' own
causal masks and position tables."""
import copy

import pytest
import torch
import torch.nn as nn

import txl_kernels
from txl_kernels.modules import (DIEngineAttentionXL, RLlibRelativeMultiHeadAttention,
                                 swap_rel_pos_attention)

import originals_gtrxl as og
from dropin_helpers import spy_on
from helpers import FUSED_DEVICE
from test_conformer import compare, rnd

DIM = 32


spy = spy_on("txl_kernels.modules.gtrxl")


# ------------------------------------------------------------------------------------- RLlib
def rllib_pair(backend="reference", heads=3, head_dim=11, layernorm=True, act="relu", seed=0):
    torch.manual_seed(seed)
    orig = og.RelativeMultiHeadAttention(DIM, DIM, heads, head_dim, input_layernorm=layernorm,
                                         output_activation=act).eval()
    if layernorm:
        with torch.no_grad():
            orig._input_layernorm.weight.normal_(1.0, 0.2)
            orig._input_layernorm.bias.normal_(0.0, 0.2)
    ours = RLlibRelativeMultiHeadAttention(DIM, DIM, heads, head_dim, input_layernorm=layernorm,
                                           output_activation=act, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


@pytest.mark.parametrize("layernorm", [True, False])
def test_rllib_state_dict_strict_both_ways(layernorm):
    orig, ours = rllib_pair(layernorm=layernorm)
    assert list(ours.state_dict()) == list(orig.state_dict())
    assert "_rel_pos_embedding.inverse_freq" in ours.state_dict()
    fresh = og.RelativeMultiHeadAttention(DIM, DIM, 3, 11, input_layernorm=layernorm,
                                          output_activation="relu")
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k


@pytest.mark.parametrize("T, Tau, act", [(1, 0, None), (5, 0, "relu"), (5, 7, "relu"),
                                         (1, 9, "tanh")])
def test_rllib_matches_original_fp64(T, Tau, act):
    B = 3
    orig, ours = rllib_pair(act=act)
    x, mem = rnd(B, T, DIM, seed=T), rnd(B, Tau, DIM, seed=Tau + 10)

    def run(mod, dtype, device):
        xx, mm = x.to(dtype).requires_grad_(), mem.to(dtype).requires_grad_()
        return (mod(xx, mm),), (xx, mm)

    compare(orig, ours, run, run, torch.float64, grads=True)


def test_rllib_causal_without_mask_tensor_and_views(spy):
    B, T, Tau = 2, 6, 4
    _, ours = rllib_pair()
    ours(rnd(B, T, DIM), rnd(B, Tau, DIM, seed=1))
    (args, kw), = spy
    assert kw["causal"] is True and kw.get("attn_mask") is None
    assert kw.get("key_padding_mask") is None
    q, k, v, r = args[:4]
    assert q.shape == (B, T, 3, 11) and k.shape == v.shape == (B, T + Tau, 3, 11)
    assert q._base is not None and q._base is k._base is v._base
    assert r.shape == (T + Tau, 3, 11) and r._base is not None


def test_rllib_fused_path_fp32():
    B, T, Tau = 2, 7, 6
    orig, ours = rllib_pair(backend="triton", heads=2, head_dim=16)
    x, mem = rnd(B, T, DIM, seed=3), rnd(B, Tau, DIM, seed=4)

    def run(mod, dtype, device):
        xx = x.to(device=device, dtype=dtype).requires_grad_()
        return (mod(xx, mem.to(device, dtype)),), (xx,)

    compare(orig, ours, run, run, torch.float32, device=FUSED_DEVICE, grads=True, name="rllib")


def test_rllib_bad_inputs():
    _, ours = rllib_pair()
    with pytest.raises(ValueError, match=r"inputs must be \[B, T, in_dim=32\]"):
        ours(rnd(2, 3, 16), rnd(2, 1, DIM))
    with pytest.raises(ValueError, match=r"memory must be \[B=2, Tau, in_dim=32\]"):
        ours(rnd(2, 3, DIM), rnd(3, 1, DIM))
    with pytest.raises(ValueError, match="unknown activation"):
        RLlibRelativeMultiHeadAttention(DIM, DIM, 2, 16, output_activation="gelu-ish")
    with pytest.raises(ValueError, match="out_dim == in_dim"):
        RLlibRelativeMultiHeadAttention(DIM, 16, 2, 16)(rnd(1, 2, DIM), rnd(1, 1, DIM))


# ---------------------------------------------------------------------------------- DI-engine
H, D = 4, 10


def ding_pair(backend="reference", head_dim=D, seed=0):
    torch.manual_seed(seed)
    orig = og.AttentionXL(DIM, head_dim, H, nn.Dropout(0.0)).eval()
    ours = DIEngineAttentionXL(DIM, head_dim, H, nn.Dropout(0.0), backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def ding_inputs(cur, prev, B=3, head_dim=D):
    mask, pos_ips = og.gtrxl_mask_and_positions(cur, prev)
    pos = og.PositionalEmbedding(DIM)(pos_ips)
    full = rnd(cur + prev, B, DIM, seed=cur)
    u, v = rnd(H, head_dim, seed=1) * 0.5, rnd(H, head_dim, seed=2) * 0.5
    return full, pos, mask, u, v


def test_ding_state_dict_strict_both_ways():
    orig, ours = ding_pair()
    assert list(ours.state_dict()) == list(orig.state_dict())
    fresh = og.AttentionXL(DIM, D, H, nn.Dropout(0.1))
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, val in fresh.state_dict().items():
        assert torch.equal(val, orig.state_dict()[k]), k


@pytest.mark.parametrize("cur, prev", [(1, 0), (1, 8), (6, 0), (6, 9)])
def test_ding_matches_original_fp64(cur, prev):
    orig, ours = ding_pair()
    full, pos, mask, u, v = ding_inputs(cur, prev)

    def run(mod, dtype, device):
        ff = full.to(dtype).requires_grad_()
        uu, vv = u.to(dtype).requires_grad_(), v.to(dtype).requires_grad_()
        pp = pos.to(dtype).requires_grad_()
        return (mod(ff[prev:], pp, ff, uu, vv, mask=mask),), (ff, pp, uu, vv)

    compare(orig, ours, run, run, torch.float64, grads=True)


def test_ding_causal_mask_is_read_as_a_band(spy):
    cur, prev = 5, 6
    _, ours = ding_pair()
    full, pos, mask, u, v = ding_inputs(cur, prev)
    ours(full[prev:], pos, full, u, v, mask=mask)
    (args, kw), = spy
    # a band: every distance up to Lk - 1 on the left, none on the right (causal)
    assert kw["causal"] is True and kw["attn_mask_band"].tolist() == [1, cur + prev - 1, 0]
    q, k, vv, r = args[:4]
    assert all(t._base is not None for t in (q, k, vv, r))
    assert k._base is vv._base


def test_ding_mask_that_allows_future_keys_is_refused():
    cur, prev = 4, 3
    _, ours = ding_pair()
    full, pos, mask, u, v = ding_inputs(cur, prev)
    with pytest.raises(ValueError, match="attend keys after them"):
        ours(full[prev:], pos, full, u, v, mask=None)
    with pytest.raises(ValueError, match="attend keys after them"):
        ours(full[prev:], pos, full, u, v, mask=torch.zeros_like(mask))
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \(cur_seq, full_seq, 1\)"):
        ours(full[prev:], pos, full, u, v, mask=mask[..., 0])
    with pytest.raises(ValueError, match=r"u must be \[head_num, head_dim\]"):
        ours(full[prev:], pos, full, u[:, :3], v, mask=mask)


def test_ding_fused_path_fp32():
    cur, prev = 6, 7
    orig, ours = ding_pair(backend="triton", head_dim=16)
    full, pos, mask, u, v = ding_inputs(cur, prev, B=2, head_dim=16)

    def run(mod, dtype, device):
        ff = full.to(device=device, dtype=dtype).requires_grad_()
        uu = u.to(device=device, dtype=dtype).requires_grad_()
        vv = v.to(device=device, dtype=dtype).requires_grad_()
        return (mod(ff[prev:], pos.to(device, dtype), ff, uu, vv, mask=mask.to(device)),), \
            (ff, uu, vv)

    compare(orig, ours, run, run, torch.float32, device=FUSED_DEVICE, grads=True, name="ding")


def test_swap_by_path():
    rl_cls = type("RelativeMultiHeadAttention", (og.RelativeMultiHeadAttention,),
                  {"__module__": "ray.rllib.models.torch.modules.relative_multi_head_attention"})
    ding_cls = type("AttentionXL", (og.AttentionXL,),
                    {"__module__": "ding.torch_utils.network.gtrxl"})
    torch.manual_seed(0)
    model = nn.ModuleDict({"rl": rl_cls(DIM, DIM, 2, 16, input_layernorm=True,
                                        output_activation="relu"),
                           "ding": ding_cls(DIM, D, H, nn.Dropout(0.0))}).eval()
    before = copy.deepcopy(model)
    assert swap_rel_pos_attention(model, backend="reference") == 2
    assert isinstance(model["rl"], RLlibRelativeMultiHeadAttention)
    assert isinstance(model["ding"], DIEngineAttentionXL)
    x, mem = rnd(2, 4, DIM), rnd(2, 3, DIM, seed=1)
    torch.testing.assert_close(model["rl"](x, mem), before["rl"](x, mem), rtol=2e-5, atol=2e-5)
    full, pos, mask, u, v = ding_inputs(4, 3)
    torch.testing.assert_close(model["ding"](full[3:], pos, full, u, v, mask=mask),
                               before["ding"](full[3:], pos, full, u, v, mask=mask),
                               rtol=2e-5, atol=2e-5)


def test_exported():
    assert txl_kernels.RLlibRelativeMultiHeadAttention is RLlibRelativeMultiHeadAttention
    assert txl_kernels.DIEngineAttentionXL is DIEngineAttentionXL
