"""icefall Conformer RelPositionMultiheadAttention drop-in against a transcription of the
original (tests/originals_icefall.py), with icefall's own mask builders and its streaming
left_context cache."""
import copy

import pytest
import torch
import torch.nn as nn

import txl_kernels
from txl_kernels.modules import IcefallRelPositionMultiheadAttention, swap_rel_pos_attention

import originals_icefall as orig_ice
from dropin_helpers import run_qkv_pos, spy_on
from helpers import FUSED_DEVICE
from test_conformer import compare, rnd

E, H = 64, 4


spy = spy_on("txl_kernels.modules.icefall")


def pair(backend="reference", embed_dim=E, heads=H, seed=0):
    torch.manual_seed(seed)
    orig = orig_ice.RelPositionMultiheadAttention(embed_dim, heads).eval()
    with torch.no_grad():  # non-trivial scales and biases
        for p in (orig.pos_bias_u, orig.pos_bias_v):
            p.normal_(0.0, 0.5)
        orig.pos_bias_u_scale.fill_(0.3)
        orig.pos_bias_v_scale.fill_(-0.2)
        orig.in_proj.bias.normal_(0.0, 0.1)
        orig.out_proj.bias.normal_(0.0, 0.1)
    ours = IcefallRelPositionMultiheadAttention(embed_dim, heads, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def pos_emb(T, left_context=0, d=E):
    enc = orig_ice.RelPositionalEncoding(d, 0.0)
    return enc(torch.zeros(1, T, d), left_context)[1]


def masks(kind, B, T):
    lengths = torch.tensor([T, T - 5, 4][:B])
    kpm = orig_ice.make_pad_mask(lengths)
    if kind == "none":
        return None, None
    if kind == "pad":
        return kpm, None
    if kind == "pad_uint8":
        return kpm.to(torch.uint8), None
    if kind == "chunk_pad":  # dynamic chunk training (Conformer.forward); fully masked rows
        return kpm, ~orig_ice.subsequent_chunk_mask(T, 4, num_left_chunks=0)
    if kind == "dense3d_pad":
        g = torch.Generator().manual_seed(2)
        m = torch.rand(B * H, T, T, generator=g) > 0.7
        m[:, :, 0] = False  # every row keeps key 0, which is never padded
        return kpm, m
    raise ValueError(kind)


def test_state_dict_strict_both_ways():
    orig, ours = pair()
    assert list(ours.state_dict()) == list(orig.state_dict())
    assert "linear_pos.weight_scale" in ours.state_dict()
    assert "linear_pos.bias_scale" not in ours.state_dict()
    fresh = orig_ice.RelPositionMultiheadAttention(E, H)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k
    # same initialisation recipe as icefall's ScaledLinear
    torch.manual_seed(5)
    a = orig_ice.RelPositionMultiheadAttention(E, H)
    torch.manual_seed(5)
    b = IcefallRelPositionMultiheadAttention(E, H)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=n)


@pytest.mark.parametrize("kind, T", [("none", 1), ("none", 13), ("pad", 13), ("pad_uint8", 13),
                                     ("chunk_pad", 13), ("dense3d_pad", 13)])
def test_matches_original_fp64_with_gradients(kind, T):
    B = 3
    orig, ours = pair()
    x = rnd(T, B, E, seed=T)
    pe = pos_emb(T)
    run = run_qkv_pos(x, pe, *masks(kind, B, T), grad_pos=True)
    compare(orig, ours, run, run, torch.float64, grads=True)


@pytest.mark.parametrize("left_context", [0, 8])
def test_streaming_left_context_matches_original(left_context):
    """ConformerEncoderLayer.chunk_forward: key = value = cat(cache, src), pos_emb from
    RelPositionalEncoding(x, left_context), key padding as streaming_forward builds it."""
    B, T = 3, 6
    orig, ours = pair()
    x = rnd(T, B, E, seed=1)
    cache = rnd(left_context, B, E, seed=2)
    pe = pos_emb(T, left_context)
    assert pe.shape[1] == left_context + 2 * T - 1
    processed_lens = torch.tensor([left_context, 3, 0]).view(B, 1)
    processed = (processed_lens <= torch.arange(left_context).expand(B, left_context)).flip(1)
    kpm = torch.cat([processed, orig_ice.make_pad_mask(torch.tensor([T, 4, 2]))], dim=1)

    def run(mod, dtype, device):
        xx, cc = x.to(dtype).requires_grad_(), cache.to(dtype).requires_grad_()
        key = torch.cat([cc, xx], dim=0)
        out = mod(xx, key, key, pe.to(dtype), key_padding_mask=kpm, left_context=left_context)
        return (out[0],), (xx, cc)

    compare(orig, ours, run, run, torch.float64, grads=True)


def test_separate_query_key_value():
    B, T = 2, 7
    orig, ours = pair()
    q, k, v = rnd(T, B, E, seed=1), rnd(T, B, E, seed=2), rnd(T, B, E, seed=3)
    pe = pos_emb(T)

    def run(mod, dtype, device):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        return (mod(*ins, pe.to(dtype))[0],), ins

    compare(orig, ours, run, run, torch.float64, grads=True)


@pytest.mark.parametrize("equal", ["query_key_value", "key_value"])
def test_distinct_tensors_with_equal_values_get_icefalls_gradients(equal):
    """icefall picks its projections with torch.equal (values): distinct tensors holding equal
    values share one projection, so only query (or key, for key = value) gets a gradient.
    Regression: the drop-in decided by identity and split the gradient over the inputs."""
    B, T = 2, 7
    orig, ours = pair()
    x, other = rnd(T, B, E, seed=1), rnd(T, B, E, seed=4)
    pe = pos_emb(T)

    def run(mod, dtype, device):
        first = x if equal == "query_key_value" else other
        ins = [t.to(dtype).clone().requires_grad_() for t in (first, x, x)]  # distinct objects
        return (mod(*ins, pe.to(dtype))[0],), ins

    compare(orig, ours, run, run, torch.float64, grads=True)
    (out,), ins = run(ours.double(), torch.float64, "cpu")
    out.sum().backward()
    assert ins[2].grad is None and (ins[1].grad is None) == (equal == "query_key_value")


def test_padding_reaches_kernel_as_key_padding_and_views(spy):
    B, T = 3, 11
    _, ours = pair()
    outs = {}
    for name in ("in_proj", "linear_pos"):
        getattr(ours, name).register_forward_hook(
            lambda m, i, o, name=name: outs.__setitem__(name, o))
    x = rnd(T, B, E)
    kpm, _ = masks("pad", B, T)
    out, weights = ours(x, x, x, pos_emb(T), key_padding_mask=kpm)
    assert weights is None and out.shape == (T, B, E)
    (args, kw), = spy
    assert kw["attn_mask"] is None and kw["causal"] is False
    assert kw.get("window_size", (-1, -1)) == (-1, -1)
    assert torch.equal(kw["key_padding_mask"], kpm)
    q, k, v, r = args[:4]
    # in_proj's weight is the scaled one, so the projection is F.linear, not the hooked module:
    # check the view relation directly
    for t in (q, k, v):
        assert t.shape == (B, T, H, E // H) and t._base is not None and t.stride(-1) == 1
    assert q._base is k._base is v._base  # one self-attention projection, three views
    assert r.shape == (2 * T - 1, H, E // H) and r._base is not None
    assert r.data_ptr() == outs["linear_pos"].data_ptr()


@pytest.mark.parametrize("kind", ["pad", "chunk_pad"])
def test_fused_path_fp32(kind):
    B, T = 2, 13
    orig, ours = pair(backend="triton")
    x = rnd(T, B, E, seed=4)
    pe = pos_emb(T)
    run = run_qkv_pos(x, pe, *masks(kind, B, T))
    compare(orig, ours, run, run, torch.float32, device=FUSED_DEVICE, grads=True,
            name=f"icefall {kind}")


def test_bad_inputs_raise_clear_errors():
    B, T = 2, 5
    _, ours = pair()
    x, pe = rnd(T, B, E), pos_emb(T)
    with pytest.raises(TypeError, match="attn_mask must be a bool or uint8.*additive"):
        ours(x, x, x, pe, attn_mask=torch.zeros(T, T))
    with pytest.raises(ValueError, match=r"attn_mask must be \(L, S\) = \(5, 5\)"):
        ours(x, x, x, pe, attn_mask=torch.zeros(T, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must be .*\(2, 5\)"):
        ours(x, x, x, pe, key_padding_mask=torch.zeros(B, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"pos_emb must be .*= 9"):
        ours(x, x, x, pos_emb(T + 1))
    with pytest.raises(ValueError, match=r"key must be \(time, batch"):
        ours(x, rnd(T + 1, B, E), rnd(T + 1, B, E), pe)
    with pytest.raises(ValueError, match="left_context must be an int"):
        ours(x, x, x, pe, left_context=-1)
    with pytest.raises(ValueError, match="embed_dim must be a positive multiple"):
        IcefallRelPositionMultiheadAttention(E, 3)


def test_swap_matches_icefall_class_by_path_and_api():
    icefall_cls = type("RelPositionMultiheadAttention", (orig_ice.RelPositionMultiheadAttention,),
                       {"__module__": "conformer"})

    class OtherRecipe(nn.Module):  # conformer_ctc's class: same path and name, no scales
        def __init__(self):
            super().__init__()
            self.in_proj = nn.Linear(E, 3 * E)

    other_cls = type("RelPositionMultiheadAttention", (OtherRecipe,), {"__module__": "conformer"})
    orig, _ = pair()
    layer = nn.Module()
    layer.self_attn = icefall_cls(E, H)
    layer.self_attn.load_state_dict(orig.state_dict())
    layer.other = other_cls()
    before = copy.deepcopy(layer)
    assert swap_rel_pos_attention(layer, backend="reference") == 1
    assert isinstance(layer.self_attn, IcefallRelPositionMultiheadAttention)
    assert type(layer.other) is other_cls
    x = rnd(7, 2, E)
    torch.testing.assert_close(layer.self_attn(x, x, x, pos_emb(7))[0],
                               before.self_attn(x, x, x, pos_emb(7))[0], rtol=2e-5, atol=2e-5)


def test_exported():
    assert txl_kernels.IcefallRelPositionMultiheadAttention is IcefallRelPositionMultiheadAttention
