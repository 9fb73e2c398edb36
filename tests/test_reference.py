"""The reference path against an independent brute-force loop over the formula (float64), and
its relative shift against the original pad/reshape _rel_shift."""
import math

import pytest
import torch

from txl_kernels import rel_attention
from txl_kernels.reference import (allowed_pairs, rel_attention_reference, rel_shift,
                                   rel_shift_pad_reshape)

from helpers import make_inputs


def brute_force(q, k, v, r, u, vb, scale, causal, window, kpm=None, mask=None):
    B, Lq, H, D = q.shape
    Lk, R = k.shape[1], r.shape[0]
    out = torch.zeros(B, Lq, H, D, dtype=torch.float64)
    wl, wr = window
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                scores, vals = [], []
                for j in range(Lk):
                    d = i + Lk - Lq - j
                    if causal and d < 0:
                        continue
                    if wl >= 0 and d > wl:
                        continue
                    if wr >= 0 and -d > wr:
                        continue
                    if kpm is not None and kpm[b, j]:
                        continue
                    if mask is not None and mask[b, h, i, j]:
                        continue
                    p = j - i + Lq - 1
                    ac = float(((q[b, i, h] + u[h]) * k[b, j, h]).sum())
                    bd = float(((q[b, i, h] + vb[h]) * r[p, h]).sum()) if 0 <= p < R else 0.0
                    scores.append(scale * (ac + bd))
                    vals.append(v[b, j, h])
                if scores:
                    m = max(scores)
                    w = [math.exp(s - m) for s in scores]
                    z = sum(w)
                    out[b, i, h] = sum(wi / z * vi for wi, vi in zip(w, vals))
    return out


CASES = [
    # Lq, Lk, R, causal, window
    (5, 5, 5, True, (-1, -1)),
    (5, 9, 9, True, (-1, -1)),        # memory 4
    (4, 11, 11, True, (3, -1)),       # same_length-like window
    (6, 6, 11, False, (-1, -1)),      # Conformer: R = 2L - 1
    (6, 6, 11, False, (2, 1)),        # local window, both sides
    (1, 7, 7, True, (-1, -1)),
]


@pytest.mark.parametrize("Lq,Lk,R,causal,window", CASES)
@pytest.mark.parametrize("masks", [False, True])
def test_reference_matches_brute_force(Lq, Lk, R, causal, window, masks):
    B, H, D = 2, 2, 5
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, R=R, dtype=torch.float64, seed=Lq + Lk)
    kpm = mask = None
    if masks:
        g = torch.Generator().manual_seed(1)
        kpm = torch.rand(B, Lk, generator=g) < 0.25
        mask = torch.rand(B, H, Lq, Lk, generator=g) < 0.2
    scale = 0.37
    got = rel_attention(q, k, v, r, u, vb, causal=causal, window_size=window,
                        key_padding_mask=kpm, attn_mask=mask, softmax_scale=scale,
                        backend="reference")
    want = brute_force(q, k, v, r, u, vb, scale, causal, window, kpm, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("qlen,klen", [(4, 4), (4, 9), (7, 7), (1, 6)])
def test_rel_shift_matches_original_pad_reshape(qlen, klen):
    bdt = torch.randn(2, 3, qlen, klen, dtype=torch.float64)  # R = klen, as in Transformer-XL
    allowed = allowed_pairs(qlen, klen, -1, 0, None, None, "cpu")[0, 0]
    ours = rel_shift(bdt, klen)
    original = rel_shift_pad_reshape(bdt)
    assert torch.equal(ours[..., allowed], original[..., allowed])
    # and it is the documented gather BD[i, j] = BDt[i, j - i + Lq - 1]
    for i in range(qlen):
        for j in range(klen):
            p = j - i + qlen - 1
            want = bdt[..., i, p] if p < klen else torch.zeros_like(bdt[..., 0, 0])
            assert torch.equal(ours[..., i, j], want)


def test_fully_masked_rows_zero_output_and_grad():
    B, Lq, Lk, H, D = 2, 4, 6, 2, 8
    ts = make_inputs(B, Lq, Lk, H, D, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    mask[0, 1, 2, :] = True  # one fully masked row
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[1] = True            # batch 1: every key padded
    out = rel_attention(*ts, key_padding_mask=kpm, attn_mask=mask, backend="reference")
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 2, 1], torch.zeros(D, dtype=out.dtype))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    (out * torch.randn_like(out)).sum().backward()
    q, k, v = ts[:3]
    for t in ts:
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 2, 1], torch.zeros(D, dtype=q.dtype))
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    assert torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))


def test_reference_lse_convention():
    B, Lq, Lk, H, D = 1, 3, 5, 1, 4
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, dtype=torch.float64)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    mask = torch.zeros(1, 1, Lq, Lk, dtype=torch.bool)
    mask[..., 0, :] = True
    _, lse = rel_attention_reference(q, k, v, r, u, vb, 0.5, -1, 0, kpm, mask, return_lse=True)
    assert lse.shape == (B, H, Lq)
    assert lse[0, 0, 0] == float("inf")
    assert torch.isfinite(lse[0, 0, 1:]).all()


def test_low_precision_scores_in_fp32():
    """fp16 inputs: the reference keeps scores in fp32, so it tracks the fp64 truth closely."""
    q, k, v, r, u, vb = make_inputs(2, 16, 24, 2, 32, dtype=torch.float16)
    got = rel_attention(q, k, v, r, u, vb, backend="reference")
    want = rel_attention(*(t.double() for t in (q, k, v, r, u, vb)), backend="reference")
    assert got.dtype == torch.float16
    assert (got.double() - want).abs().max() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("big", [False, True])
def test_low_precision_scores_accumulate_in_fp32(dtype, big):
    """Regression: AC and BD were einsums in fp16/bf16, so |q . k| past 65504 made fp16 rows
    NaN, and the error was 2-3x the fused kernel's. Now the reference is finite and no less
    accurate than the fused kernel, both measured against a float64 oracle."""
    from helpers import FUSED_DEVICE
    ts = make_inputs(2, 19, 37, 2, 41, dtype=dtype, device=FUSED_DEVICE, seed=2, scale=2.0)
    if big:  # raw |q . k| well past the fp16 range
        ts[0], ts[1] = ts[0] * 60, ts[1] * 60
        qk = torch.einsum("bihd,bjhd->bhij", ts[0].double(), ts[1].double()).abs().max()
        assert qk > 2 * 65504
    truth = rel_attention(*[t.double() for t in ts], backend="reference")
    ref = rel_attention(*ts, backend="reference")
    fused = rel_attention(*ts, backend="triton")
    assert torch.isfinite(ref).all()
    err_ref = (ref.double() - truth).abs().max().item()
    err_fused = (fused.double() - truth).abs().max().item()
    ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype] * truth.abs().max().item()
    assert err_ref <= 1.2 * err_fused + 1e-3 * ulp, (err_ref, err_fused)
    g = [t.detach().requires_grad_(True) for t in ts]
    rel_attention(*g, backend="reference").float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in g)
