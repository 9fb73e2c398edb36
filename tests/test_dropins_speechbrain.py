"""SpeechBrain RelPosMHAXL drop-in against a transcription of the original
(tests/originals_speechbrain.py), with SpeechBrain's own position table and mask builders; and
against the real class when speechbrain is importable."""
import copy
import importlib.util

import pytest
import torch
import torch.nn as nn

import txl_kernels
from txl_kernels.modules import SpeechBrainRelPosMHAXL, swap_rel_pos_attention

import originals_speechbrain as sb
from dropin_helpers import run_qkv_pos, spy_on
from helpers import FUSED_DEVICE
from test_conformer import compare, rnd

E, H = 64, 4


spy = spy_on("txl_kernels.modules.speechbrain")


class Original(sb.RelPosMHAXL):
    """The transcription, with a float64 softmax when run in float64 (see originals)."""

    def forward(self, *args, **kwargs):
        self.softmax_dtype = torch.float64 if args[0].dtype == torch.float64 else torch.float32
        return super().forward(*args, **kwargs)


def pair(backend="reference", vbias=False, mask_pos_future=False, seed=0):
    torch.manual_seed(seed)
    orig = Original(E, H, vbias=vbias, mask_pos_future=mask_pos_future).eval()
    with torch.no_grad():
        orig.out_proj.bias.normal_(0.0, 0.1)
        if vbias:
            orig.value_bias_weight.normal_(0.0, 0.5)
    ours = SpeechBrainRelPosMHAXL(E, H, vbias=vbias, mask_pos_future=mask_pos_future,
                                  backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def pos_embs(S):
    return sb.RelPosEncXL(E)(torch.zeros(1, S, E))


def masks(kind, B, T):
    lengths = torch.tensor([T, T - 4, 3][:B])
    kpm = ~sb.length_to_mask(lengths).bool()
    if kind == "none":
        return None, None
    if kind == "pad":
        return kpm, None
    if kind == "lookahead_pad":  # the decoder's causal float mask
        return kpm, sb.get_lookahead_mask(torch.zeros(B, T))
    if kind == "bool3d_pad":
        g = torch.Generator().manual_seed(3)
        m = torch.rand(B * H, T, T, generator=g) > 0.6
        m[..., 0] = False
        return kpm, m
    if kind == "bool2d":  # a band: queries see keys up to 2 ahead
        return None, torch.arange(T)[None] > torch.arange(T)[:, None] + 2
    raise ValueError(kind)


@pytest.mark.parametrize("vbias", [False, True])
def test_state_dict_strict_both_ways(vbias):
    orig, ours = pair(vbias=vbias)
    assert list(ours.state_dict()) == list(orig.state_dict())
    fresh = Original(E, H, vbias=vbias)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k
    other = SpeechBrainRelPosMHAXL(E, H, vbias=not vbias)
    with pytest.raises(RuntimeError):
        other.load_state_dict(orig.state_dict(), strict=True)
    assert ours.pos_bias_u.shape == (E // H, H)  # stored (head_dim, num_heads)


@pytest.mark.parametrize("kind, T, vbias", [
    ("none", 1, False), ("none", 14, True), ("pad", 14, False), ("lookahead_pad", 14, True),
    ("bool3d_pad", 14, False), ("bool2d", 9, False)])
def test_self_attention_matches_original_fp64(kind, T, vbias):
    B = 3
    orig, ours = pair(vbias=vbias)
    x = rnd(B, T, E, seed=T)
    pe = pos_embs(T)
    run = run_qkv_pos(x, pe, *masks(kind, B, T), grad_pos=True)
    compare(orig, ours, run, run, torch.float64, grads=True)


@pytest.mark.parametrize("L, S", [(5, 12), (12, 12)])
def test_distinct_query_key_value_block_layout(L, S):
    """Distinct tensors take the block layout of in_proj_weight (cross-attention, memory)."""
    B = 2
    orig, ours = pair(vbias=True)
    q, kv = rnd(B, L, E, seed=1), rnd(B, S, E, seed=2)
    pe = pos_embs(S)
    kpm = ~sb.length_to_mask(torch.tensor([S, S - 3])).bool()

    def run(mod, dtype, device):
        qq, kk = q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_()
        return (mod(qq, kk, kk * 1.0, pe.to(dtype), key_padding_mask=kpm)[0],), (qq, kk)

    compare(orig, ours, run, run, torch.float64, grads=True)


def test_mask_pos_future_changes_nothing():
    """The original applies its tril before cutting the shifted term to S columns: no effect."""
    B, T = 2, 10
    x, pe = rnd(B, T, E, dtype=torch.float64), pos_embs(T).double()
    plain, _ = pair()
    fut, ours = pair(mask_pos_future=True)
    fut, plain, ours = fut.double(), plain.double(), ours.double()
    want = plain(x, x, x, pe)[0]
    torch.testing.assert_close(fut(x, x, x, pe)[0], want, rtol=0, atol=0)
    torch.testing.assert_close(ours(x, x, x, pe)[0], want, rtol=1e-9, atol=1e-10)


def test_padding_and_lookahead_reach_kernel_without_dense_reads(spy):
    B, T = 3, 11
    _, ours = pair()
    x, pe = rnd(B, T, E), pos_embs(T)
    kpm, am = masks("lookahead_pad", B, T)
    out = ours(x, x, x, pe, key_padding_mask=kpm)
    assert isinstance(out, tuple) and out[1] is None
    ours(x, x, x, pe, key_padding_mask=kpm, attn_mask=am, return_attn_weights=False)
    (a0, kw0), (a1, kw1) = spy
    assert kw0["attn_mask"] is None and torch.equal(kw0["key_padding_mask"], kpm)
    # causal (a band: left up to Lk - 1, right 0): the kernel reads no mask
    assert kw1["attn_mask_band"].tolist() == [1, T - 1, 0]
    q, k, v, r = a0[:4]
    assert q._base is not None and q._base is k._base is v._base
    assert r.shape == (2 * T - 1, H, E // H) and r._base is not None
    u = a0[4]
    assert u._base is ours.pos_bias_u or u.data_ptr() == ours.pos_bias_u.data_ptr()


@pytest.mark.parametrize("kind", ["pad", "lookahead_pad"])
def test_fused_path_fp32(kind):
    B, T = 2, 13
    orig, ours = pair(backend="triton", vbias=True)
    x, pe = rnd(B, T, E, seed=6), pos_embs(T)
    run = run_qkv_pos(x, pe, *masks(kind, B, T))
    compare(orig, ours, run, run, torch.float32, device=FUSED_DEVICE, grads=True,
            name=f"speechbrain {kind}")


def test_bad_inputs_raise_clear_errors():
    B, T = 2, 6
    _, ours = pair()
    x, pe = rnd(B, T, E), pos_embs(T)
    with pytest.raises(TypeError, match="must be bool.*uint8.*adds it"):
        ours(x, x, x, pe, attn_mask=torch.zeros(T, T, dtype=torch.uint8))
    with pytest.raises(ValueError, match="only 0 and -inf"):
        ours(x, x, x, pe, attn_mask=torch.full((T, T), -1.0))
    with pytest.raises(ValueError, match=r"attn_mask must be \(L, S\) = \(6, 6\)"):
        ours(x, x, x, pe, attn_mask=torch.zeros(T, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"pos_embs must be \(1, 2S - 1 = 11"):
        ours(x, x, x, pos_embs(T + 1))
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        ours(x, x[:, :3], x[:, :3], pos_embs(3))
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor \(B, S\)"):
        ours(x, x, x, pe, key_padding_mask=torch.zeros(B, T, dtype=torch.uint8))
    with pytest.raises(NotImplementedError, match="vdim"):
        SpeechBrainRelPosMHAXL(E, H, vdim=32)(x, x, x, pe)


def test_swap_by_path():
    cls = type("RelPosMHAXL", (sb.RelPosMHAXL,), {"__module__": "speechbrain.nnet.attention"})
    torch.manual_seed(0)
    model = nn.Sequential(cls(E, H, vbias=True)).eval()
    before = copy.deepcopy(model)
    assert swap_rel_pos_attention(model, backend="reference") == 1
    assert isinstance(model[0], SpeechBrainRelPosMHAXL)
    x, pe = rnd(2, 7, E), pos_embs(7)
    torch.testing.assert_close(model[0](x, x, x, pe)[0], before[0](x, x, x, pe)[0],
                               rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(importlib.util.find_spec("speechbrain") is None,
                    reason="speechbrain is not installed (it needs torchaudio, which pins "
                           "another torch); the transcription above stands in for it")
def test_against_real_speechbrain():
    from speechbrain.nnet.attention import RelPosEncXL, RelPosMHAXL
    torch.manual_seed(0)
    real = RelPosMHAXL(E, H, vbias=True).eval()
    ours = SpeechBrainRelPosMHAXL(E, H, vbias=True, backend="reference").eval()
    ours.load_state_dict(real.state_dict(), strict=True)
    x = rnd(3, 12, E)
    pe = RelPosEncXL(E)(x)
    kpm = ~sb.length_to_mask(torch.tensor([12, 8, 3])).bool()
    torch.testing.assert_close(ours(x, x, x, pe, key_padding_mask=kpm)[0],
                               real(x, x, x, pe, key_padding_mask=kpm)[0], rtol=2e-5, atol=2e-5)


def test_exported():
    assert txl_kernels.SpeechBrainRelPosMHAXL is SpeechBrainRelPosMHAXL
