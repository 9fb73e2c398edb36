"""FusedRelAttention against a transcription of the original Transformer-XL layer."""
import pytest
import torch

import txl_kernels.modules.transformer_xl as txl_mod
from txl_kernels import FusedRelAttention, mask_to_band

from helpers import FUSED_DEVICE
from txl_original import PositionalEmbedding, RelPartialLearnableMultiHeadAttn, dec_attn_mask

N_HEAD, D_MODEL, D_HEAD = 2, 32, 16


def _pair(pre_lnorm=False, dtype=torch.float64, backend="reference", **kw):
    torch.manual_seed(0)
    orig = RelPartialLearnableMultiHeadAttn(N_HEAD, D_MODEL, D_HEAD, 0.0, pre_lnorm=pre_lnorm)
    ours = FusedRelAttention(N_HEAD, D_MODEL, D_HEAD, 0.0, pre_lnorm=pre_lnorm, backend=backend,
                             **kw)
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig.to(dtype), ours.to(dtype)


def _data(qlen, mlen, bsz=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(qlen, bsz, D_MODEL, generator=g).to(dtype)
    mems = torch.randn(mlen, bsz, D_MODEL, generator=g).to(dtype) if mlen else None
    klen = qlen + mlen
    pos_seq = torch.arange(klen - 1, -1, -1.0)
    r = PositionalEmbedding(D_MODEL)(pos_seq).to(dtype)
    rwb = torch.randn(N_HEAD, D_HEAD, generator=g).to(dtype) * 0.5
    rrb = torch.randn(N_HEAD, D_HEAD, generator=g).to(dtype) * 0.5
    return w, r, rwb, rrb, mems


def test_state_dict_keys_and_strict_load_both_ways():
    orig, ours = _pair()
    assert list(orig.state_dict()) == list(ours.state_dict())
    orig.load_state_dict(ours.state_dict(), strict=True)
    tied = FusedRelAttention(N_HEAD, D_MODEL, D_HEAD, 0.0, untie_r=True)
    assert set(tied.state_dict()) == set(orig.state_dict()) | {"r_w_bias", "r_r_bias"}
    assert tied.r_w_bias.shape == (N_HEAD, D_HEAD)


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("qlen,mlen", [(7, 0), (7, 5), (4, 9), (1, 6)])
@pytest.mark.parametrize("mask_mode", ["detect", "dense"])
def test_matches_original_causal(pre_lnorm, qlen, mlen, mask_mode):
    orig, ours = _pair(pre_lnorm, mask_mode=mask_mode)
    w, r, rwb, rrb, mems = _data(qlen, mlen)
    mask = dec_attn_mask(qlen, mlen, w.device)
    want = orig(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    got = ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # original rounds scores to fp32


@pytest.mark.parametrize("qlen,mlen,mem_len", [(6, 6, 6), (5, 8, 8), (6, 4, 6)])
def test_matches_original_same_length(qlen, mlen, mem_len):
    orig, ours = _pair()
    w, r, rwb, rrb, mems = _data(qlen, mlen)
    mask = dec_attn_mask(qlen, mlen, w.device, same_length=True, mem_len=mem_len)
    is_band, left, right = mask_to_band(mask.bool()[:, :, 0]).tolist()
    assert is_band == 1 and right == 0
    assert left == min(mem_len - 1, qlen + mlen - 1)
    want = orig(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    torch.testing.assert_close(ours(w, r, rwb, rrb, attn_mask=mask, mems=mems), want,
                               rtol=1e-6, atol=1e-7)  # original rounds scores to fp32
    causal_mode = FusedRelAttention(N_HEAD, D_MODEL, D_HEAD, 0.0, mem_len=mem_len,
                                    mask_mode="causal", same_length=True, backend="reference")
    causal_mode.load_state_dict(ours.state_dict())
    causal_mode.double()
    torch.testing.assert_close(causal_mode(w, r, rwb, rrb, attn_mask=None, mems=mems), want,
                               rtol=1e-6, atol=1e-7)  # original rounds scores to fp32


def test_other_masks_are_applied_densely():
    orig, ours = _pair()
    qlen, mlen = 6, 4
    w, r, rwb, rrb, mems = _data(qlen, mlen)
    causal = dec_attn_mask(qlen, mlen, w.device).bool()
    extra = torch.rand(qlen, qlen + mlen, 3) < 0.3
    extra[:, -1] = False  # keep every row non-empty (the original would give NaN rows)
    for mask in (causal | extra, (causal | extra[:, :, :1])[:, :, 0]):
        assert mask_to_band(mask if mask.dim() == 2 else mask.permute(2, 0, 1))[0] == 0
        want = orig(w, r, rwb, rrb, attn_mask=mask, mems=mems)
        torch.testing.assert_close(ours(w, r, rwb, rrb, attn_mask=mask, mems=mems), want,
                                   rtol=1e-6, atol=1e-7)  # original rounds scores to fp32


def test_detect_passes_band_without_host_sync(monkeypatch):
    seen = []
    real = txl_mod.rel_attention

    def spy(q, k, v, r, u, vb, **kw):
        seen.append((q, k, v, r, kw))
        return real(q, k, v, r, u, vb, **kw)

    monkeypatch.setattr(txl_mod, "rel_attention", spy)
    calls = []
    real_band = txl_mod.mask_to_band
    monkeypatch.setattr(txl_mod, "mask_to_band", lambda m: calls.append(1) or real_band(m))
    _, ours = _pair()
    w, r, rwb, rrb, mems = _data(5, 3)
    mask = dec_attn_mask(5, 3, w.device)

    def no_host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor value during forward")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
            m.setattr(torch.Tensor, name, no_host_read)
        ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)
        ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)  # recomputed on the device
    assert len(calls) == 2
    q, k, v, rr, kw = seen[0]
    assert kw["attn_mask_band"].tolist() == [1, 7, 0]
    # q, k, v, r are strided views of the projections, not copies (r is not padded either)
    assert q._base is not None and k._base is not None and v._base is not None
    assert rr._base is not None and rr.shape[0] == r.shape[0]
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    mask[0, -1, 0] = 0  # in-place change (unmasks a future key): recomputed, now not a band
    ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    assert len(calls) == 3 and seen[-1][4]["attn_mask_band"][0].item() == 0


@pytest.mark.parametrize("how", ["data_copy", "numpy_write"])
def test_detect_never_uses_a_stale_band(how):
    """Regression: the id()-keyed band cache returned the causal band after the mask was
    changed without a version bump (``mask.data.copy_``, writes through ``.numpy()``)."""
    _, detect = _pair()
    _, dense = _pair(mask_mode="dense")
    w, r, rwb, rrb, mems = _data(5, 3)
    mask = dec_attn_mask(5, 3, w.device)
    torch.testing.assert_close(detect(w, r, rwb, rrb, attn_mask=mask, mems=mems),
                               dense(w, r, rwb, rrb, attn_mask=mask, mems=mems))
    version = mask._version
    other = mask.clone()
    other[:, :2] = 1  # hide the first two memory keys as well: not a band
    if how == "data_copy":
        mask.data.copy_(other)
    else:
        mask.numpy()[...] = other.numpy()
    assert mask._version == version and torch.equal(mask, other)
    torch.testing.assert_close(detect(w, r, rwb, rrb, attn_mask=mask, mems=mems),
                               dense(w, r, rwb, rrb, attn_mask=other.clone(), mems=mems))


def test_mems_empty_and_none_equal():
    _, ours = _pair()
    w, r, rwb, rrb, _ = _data(5, 0)
    a = ours(w, r, rwb, rrb, attn_mask=dec_attn_mask(5, 0, w.device), mems=None)
    b = ours(w, r, rwb, rrb, attn_mask=dec_attn_mask(5, 0, w.device), mems=w.new_empty(0))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_owned_biases_used_unless_passed():
    ours = FusedRelAttention(N_HEAD, D_MODEL, D_HEAD, 0.0, untie_r=True,
                             backend="reference").double()
    w, r, rwb, rrb, mems = _data(4, 3)
    mask = dec_attn_mask(4, 3, w.device)
    own = ours(w, r, attn_mask=mask, mems=mems)
    passed = ours(w, r, ours.r_w_bias, ours.r_r_bias, attn_mask=mask, mems=mems)
    torch.testing.assert_close(own, passed, rtol=0, atol=0)
    other = ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    assert not torch.allclose(own, other)
    with pytest.raises(ValueError, match="r_w_bias and r_r_bias"):
        FusedRelAttention(N_HEAD, D_MODEL, D_HEAD, 0.0)(w.float(), r.float())


def test_gradients_match_original():
    orig, ours = _pair()
    w, r, rwb, rrb, mems = _data(5, 4)
    mask = dec_attn_mask(5, 4, w.device)
    grads = []
    for mod in (orig, ours):
        ws = w.clone().requires_grad_(True)
        rw, rr = rwb.clone().requires_grad_(True), rrb.clone().requires_grad_(True)
        mod.zero_grad()
        mod(ws, r, rw, rr, attn_mask=mask, mems=mems).square().sum().backward()
        grads.append([ws.grad, rw.grad, rr.grad] + [p.grad for p in mod.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # original rounds scores to fp32


def test_bad_inputs():
    _, ours = _pair(dtype=torch.float32)
    w, r, rwb, rrb, mems = _data(4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="attn_mask must be"):
        ours(w, r, rwb, rrb, attn_mask=torch.zeros(4, 6, dtype=torch.bool), mems=mems)
    with pytest.raises(TypeError, match="attn_mask must be uint8 or bool"):
        ours(w, r, rwb, rrb, attn_mask=torch.zeros(4, 7), mems=mems)
    with pytest.raises(ValueError, match="mems must be"):
        ours(w, r, rwb, rrb, mems=mems[:, :1])
    with pytest.raises(ValueError, match="w must be"):
        ours(w[0], r, rwb, rrb)
    with pytest.raises(ValueError, match="r must be"):
        ours(w, r[:, 0], rwb, rrb)
    with pytest.raises(ValueError, match="mask_mode"):
        FusedRelAttention(2, 32, 16, 0.0, mask_mode="auto")
    with pytest.raises(ValueError, match="same_length needs mem_len"):
        FusedRelAttention(2, 32, 16, 0.0, same_length=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_backend_matches_original(dtype):
    orig, ours = _pair(dtype=dtype, backend="triton")
    orig, ours = orig.to(FUSED_DEVICE), ours.to(FUSED_DEVICE)
    w, r, rwb, rrb, mems = (t.to(FUSED_DEVICE) for t in _data(9, 7, bsz=2, dtype=dtype))
    mask = dec_attn_mask(9, 7, w.device)
    want = orig.double()(w.double(), r.double(), rwb.double(), rrb.double(), attn_mask=mask,
                         mems=mems.double())
    got = ours(w, r, rwb, rrb, attn_mask=mask, mems=mems)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("qlen,mlen", [(5, 0), (4, 3)])
def test_detect_strictly_causal_mask_equals_dense(backend, qlen, mlen):
    """Regression: detect mode with ``triu(ones(qlen, klen), mlen)`` (no self-attention)
    attended row 0 through a band read as unbounded. Forward and gradients equal dense mode."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    _, detect = _pair(dtype=dtype, backend=backend)
    _, dense = _pair(dtype=dtype, backend=backend, mask_mode="dense")
    detect, dense = detect.to(FUSED_DEVICE), dense.to(FUSED_DEVICE)
    w, r, rwb, rrb, mems = (None if t is None else t.to(FUSED_DEVICE)
                            for t in _data(qlen, mlen, bsz=2, dtype=dtype))
    mask = torch.triu(torch.ones(qlen, qlen + mlen, dtype=torch.uint8, device=FUSED_DEVICE),
                      mlen)
    outs = []
    for mod in (detect, dense):
        ww = w.detach().requires_grad_(True)
        out = mod(ww, r, rwb, rrb, attn_mask=mask, mems=mems)
        out.square().sum().backward()
        outs.append([out.detach(), ww.grad] + [p.grad for p in mod.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [5, 12, 1])
def test_position_table_of_another_length_raises(rows):
    """Regression: r with 5 or 12 rows for klen 9 silently shifted or zeroed distances (the
    original's AC + BD shapes disagree and raise). The error names r, the rows given and
    the rows needed."""
    _, ours = _pair()
    w, r, rwb, rrb, mems = _data(5, 4)  # klen = 9
    bad = PositionalEmbedding(D_MODEL)(torch.arange(rows - 1, -1, -1.0)).double()
    with pytest.raises(ValueError, match=rf"r must have klen = mlen \+ qlen = 9 rows.*got "
                                         rf"{rows} rows"):
        ours(w, bad, rwb, rrb, attn_mask=dec_attn_mask(5, 4, w.device), mems=mems)
    ours(w, r, rwb, rrb, attn_mask=dec_attn_mask(5, 4, w.device), mems=mems)  # 9 rows: fine
