"""Attention dropout inside the fused kernels.

The keep-mask is a Philox function of (b, h, i, j) and the (seed, offset) tensor the call drew
from PyTorch's default generator; ``ops.rel_attn_fwd.dropout_keep_mask`` returns it (computed
by the kernels' own jit helper). Exactness: the fused forward and every gradient equal the
reference given that same mask. Statistics: keep rate within a binomial bound, the mean output
over many masks approaches the undropped output. Identity: for a fixed seed the output is
linear in v, so <dv, w> == <dout, forward(v=w)> only if the backward used the forward's mask.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py) and on the GPU when there is one.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import txl_kernels
import txl_kernels._op
from txl_kernels import FusedRelAttention, rel_attention
from txl_kernels.modules.conformer import (ESPnetRelPositionMultiHeadedAttention,
                                           NeMoRelPositionMultiHeadAttention)
from txl_kernels.ops._common import (_call_threshold, _keep_flags, dropout_apply, dropout_flags,
                                    dropout_keep, dropout_keep_block, dropout_keep_scale,
                                    dropout_rate, dropout_threshold, load_dropout_seed)
from txl_kernels.ops.rel_attn_fwd import dropout_keep_mask, draw_dropout_seed, rel_attn_fwd
from txl_kernels.reference import rel_attention_reference

from helpers import FUSED_DEVICE, assert_within, make_inputs

DEV = FUSED_DEVICE
NAMES = ("out", "dq", "dk", "dv", "dr", "du", "dvb")


def _masks(kind, B, Lq, Lk, H):
    """(window_left, window_right, key_padding_mask, attn_mask) of a test case."""
    g = torch.Generator().manual_seed(3)
    if kind == "causal_kpm":  # causal with a memory, padded keys (one whole row masked)
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, :Lk - Lq + 1] = True  # query row 0 of batch 0 sees no key
        kpm[-1, Lk - 5] = True
        return -1, 0, kpm.to(DEV), None
    if kind == "window_dense":  # a two-sided window and a dense random mask
        mask = torch.rand(B, 1, Lq, Lk, generator=g) < 0.3
        return 11, 3, None, mask.to(DEV)
    return -1, -1, None, None


def _public_call_and_mask(ts, p, wl, wr, kpm, mask, seed, deterministic=True):
    """rel_attention(backend="triton") under torch.manual_seed(seed), and the keep-mask that
    call used: the fused path draws its (seed, offset) first, with draw_dropout_seed."""
    q, k = ts[0], ts[1]
    B, Lq, H, _ = q.shape
    torch.manual_seed(seed)
    out = rel_attention(*ts, causal=False, window_size=(wl, wr), key_padding_mask=kpm,
                        attn_mask=mask,
                        dropout_p=p, backend="triton", deterministic=deterministic)
    torch.manual_seed(seed)
    keep = dropout_keep_mask(draw_dropout_seed(q.device), B, H, Lq, k.shape[1], p)
    return out, keep


@pytest.mark.parametrize("dtype,kind,deterministic", [
    (torch.float32, "causal_kpm", True), (torch.float32, "window_dense", False),
    (torch.float16, "causal_kpm", False), (torch.float16, "window_dense", True)])
def test_forward_and_grads_equal_reference_with_kernel_mask(dtype, kind, deterministic):
    B, Lq, Lk, H, D, p = (2 if dtype == torch.float32 else 1), 19, 37, 2, 41, 0.3
    ts = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, dtype=dtype, device=DEV,
                     requires_grad=True, seed=1)
    wl, wr, kpm, mask = _masks(kind, B, Lq, Lk, H)
    out, keep = _public_call_and_mask(ts, p, wl, wr, kpm, mask, seed=11,
                                      deterministic=deterministic)
    assert 0.55 < keep.float().mean() < 0.85
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    got = (out, *torch.autograd.grad(out, ts, dout))
    scale = D ** -0.5

    def ref(inputs, d_out):
        o = rel_attention_reference(*inputs, scale, wl, wr, kpm, mask, dropout_p=p,
                                    dropout_mask=keep)
        return (o, *torch.autograd.grad(o, inputs, d_out))

    same = ref([t.detach().requires_grad_(True) for t in ts], dout)
    truth = ref([t.detach().double().requires_grad_(True) for t in ts], dout.double())
    for name, a, s, t in zip(NAMES, got, same, truth):
        assert a.dtype == dtype
        assert_within(name, a.detach(), s.detach(), t.detach(), factor=3.0)
    # rows with no allowed key: output and gradients 0
    if kind == "causal_kpm":
        assert torch.all(got[0][0, 0] == 0) and torch.all(got[1][0, 0] == 0)


def test_reference_with_mask_differs_from_undropped_and_wrong_mask():
    """The exactness test above can fail: a different mask gives a different output."""
    B, Lq, Lk, H, D, p = 1, 9, 17, 2, 16, 0.4
    ts = make_inputs(B, Lq, Lk, H, D, device=DEV)
    out, keep = _public_call_and_mask(ts, p, -1, 0, None, None, seed=5)
    want = rel_attention_reference(*ts, D ** -0.5, -1, 0, dropout_p=p, dropout_mask=keep)
    other = rel_attention_reference(*ts, D ** -0.5, -1, 0, dropout_p=p,
                                    dropout_mask=torch.roll(keep, 1, dims=-1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert (out - other).abs().max() > 1e-2
    assert (out - rel_attention_reference(*ts, D ** -0.5, -1, 0)).abs().max() > 1e-2


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_binomial_bound(p):
    B, H, Lq, Lk = 3, 2, 37, 53
    keep = dropout_keep_mask(draw_dropout_seed(DEV), B, H, Lq, Lk, p)
    assert keep.shape == (B, H, Lq, Lk) and keep.dtype == torch.bool
    n = keep.numel()
    p_drop = dropout_rate(p)  # p to within 2^-24 (ops/_common.py)
    sigma = math.sqrt(p_drop * (1 - p_drop) / n)
    assert abs(keep.float().mean().item() - (1 - p_drop)) < 5 * sigma
    # no visible structure along rows, columns, heads or batches: each slice's rate is binomial
    for dims in ((0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)):
        rates = keep.float().mean(dim=dims)
        m = n // rates.numel()
        assert (rates - (1 - p_drop)).abs().max() < 5.5 * math.sqrt(p_drop * (1 - p_drop) / m), \
            dims


@pytest.mark.parametrize("p", [3e-4, 0.003])
def test_drop_rate_matches_p_below_one_256th(p):
    """Below 1/256 the mask drops at rate p (a floored 8-bit threshold dropped nothing there):
    the kept fraction over 2^19 elements within a binomial bound."""
    torch.manual_seed(4)
    keep = dropout_keep_mask(draw_dropout_seed(DEV), 2, 4, 128, 512, p)
    n = keep.numel()
    rate = 1.0 - keep.float().mean().item()
    assert abs(rate - p) < 5.5 * math.sqrt(p * (1 - p) / n), (rate, p)


def test_dropout_rate_resolves_every_p():
    """The rate the kernels use is p to within 2^-24, never 0 for p > 0 (nor 1), and the
    kept values' scale is 1 / (1 - that rate)."""
    for p in (1e-12, 1e-7, 1e-4, 0.001, 1 / 3, 0.5, 0.99, 0.999, 1 - 1e-7, 1 - 1e-12):
        rate = dropout_rate(p)
        assert 0.0 < rate < 1.0, (p, rate)
        assert abs(rate - p) <= 2.0 ** -24 or p < 2.0 ** -24 or p > 1 - 2.0 ** -24, (p, rate)
        assert dropout_keep_scale(p) == 1.0 / (1.0 - rate)
    assert dropout_rate(1e-12) == 2.0 ** -23 and dropout_rate(1 - 1e-12) == 1 - 2.0 ** -23
    assert dropout_threshold(0.0) == 0 and dropout_keep_scale(0.0) == 1.0


# E[out] / undropped over seeds. With q = u = vb = 0 every score is 0, so P is uniform over
# the Lk keys, and with v = 1 the undropped output is 1 and a row's dropped output is its kept
# fraction times the kept values' scale: its mean over n elements has standard deviation
# sqrt(p / (1 - p) / n) (the 16 elements of one Philox call share a dithered threshold, which
# adds a few percent at most; the bound allows 6 of them). The old mask (rate floor(256 p) /
# 256, scale 1 / (1 - p)) gave 1.001 at p = 0.001, 1.0026 at 0.1, 1.17 at 0.99, 3.9 at 0.999.
UNBIASED_P = [0.001, 0.1, 0.5, 0.99, 0.999]


def _uniform_inputs(B, Lq, Lk, H, D=16):
    r = torch.randn(Lk + Lq - 1, H, D, generator=torch.Generator().manual_seed(1))
    return (torch.zeros(B, Lq, H, D), torch.zeros(B, Lk, H, D), torch.ones(B, Lk, H, D), r,
            torch.zeros(H, D), torch.zeros(H, D))


def _assert_unbiased(outs, p, n):
    mean = torch.cat([o[..., 0].double().flatten() for o in outs]).mean().item()
    sigma = math.sqrt(p / (1 - p) / n)
    assert abs(mean - 1.0) < 6 * sigma, (p, mean, sigma)


@pytest.mark.parametrize("p", UNBIASED_P)
def test_cpu_backend_output_unbiased_over_seeds(p, extension, cpu_isa):
    """The C++ kernel: 4 seeds x 2^20 elements (enough for the old 0.26 % bias at p = 0.1)."""
    B, Lq, Lk, H = 2, 256, 1024, 2
    ts = _uniform_inputs(B, Lq, Lk, H)
    outs = []
    for s in range(4):
        torch.manual_seed(40 + s)
        outs.append(rel_attention(*ts, causal=False, dropout_p=p, backend="cpu"))
    _assert_unbiased(outs, p, 4 * B * H * Lq * Lk)


@pytest.mark.parametrize("p", UNBIASED_P)
def test_triton_forward_output_unbiased_over_seeds(p):
    """The Triton forward (the interpreter on CPU: large tiles keep it quick): 2 seeds x 2^18
    elements, enough for the old bias at p = 0.001, 0.99 and 0.999."""
    B, Lq, Lk, H = 1, 128, 1024, 2
    q, k, v, r, u, vb = (t.to(DEV) for t in _uniform_inputs(B, Lq, Lk, H))
    outs = []
    for s in range(2):
        torch.manual_seed(50 + s)
        out, _ = rel_attn_fwd(q, k, v, r, u, vb, 0.25, -1, -1, dropout_p=p,
                              config={"BLOCK_M": 128, "BLOCK_N": 512} if DEV == "cpu" else None)
        outs.append(out.cpu())
    _assert_unbiased(outs, p, 2 * B * H * Lq * Lk)


@pytest.mark.parametrize("p", [0.001, 0.3, 0.5, 0.999])
def test_cpu_kernel_drops_exactly_the_triton_mask(p, extension, cpu_isa):
    """The C++ kernel's mask is dropout_keep_mask's bit for bit, dithered threshold included:
    with uniform P over Lk keys and v[j] the unit vector e_j, out[i, j] is keep[i, j] times
    the scale / Lk."""
    from txl_kernels._op import rel_attn_func

    B, Lq, Lk, H = 2, 40, 64, 2
    q, k, _, r, u, vb = _uniform_inputs(B, Lq, Lk, H, D=Lk)
    v = torch.eye(Lk)[None, :, None, :].expand(B, Lk, H, Lk).contiguous()
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    out = rel_attn_func(q, k, v, r, u, vb, 0.125, -1, -1, dropout_p=p, dropout_seed=seed)
    got = out.permute(0, 2, 1, 3)  # [B, H, Lq, Lk]
    keep = dropout_keep_mask(seed, B, H, Lq, Lk, p)
    assert torch.equal(got != 0, keep)
    assert torch.all(got[keep] == torch.tensor(dropout_keep_scale(p) / Lk, dtype=torch.float32))


def test_keep_mask_is_a_function_of_b_h_i_j_and_seed():
    seed = draw_dropout_seed(DEV)
    big = dropout_keep_mask(seed, 2, 2, 21, 70, 0.3)
    # another Lk (other tiles): the common columns agree
    assert torch.equal(dropout_keep_mask(seed, 2, 2, 21, 17, 0.3), big[..., :17])
    other = seed.clone()
    other[1] += 1  # another offset: another mask
    assert not torch.equal(dropout_keep_mask(other, 2, 2, 21, 70, 0.3), big)
    other = seed.clone()
    other[0] += 1  # another seed
    assert not torch.equal(dropout_keep_mask(other, 2, 2, 21, 70, 0.3), big)


@triton.jit
def _flags_kernel(W, T, F, NW: tl.constexpr, NT: tl.constexpr):
    w = tl.load(W + tl.arange(0, NW)).to(tl.uint32, bitcast=True)
    t = tl.load(T + tl.arange(0, NT)).to(tl.uint32)
    f = _keep_flags(w[None, :], (128 - t[:, None]) * 0x01010101)
    tl.store(F + tl.arange(0, NT)[:, None] * NW + tl.arange(0, NW)[None, :],
             f.to(tl.int32, bitcast=True))


def _as_int32(words):
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_keep_flags_compare_every_byte_with_every_threshold():
    """The four-bytes-at-once compare: bit 8 k + 7 of the flags is (byte k's low 7 bits >=
    the call's threshold), for every byte value in every position and every threshold 0..128
    (128: T = 127 raised by the dither, nothing kept)."""
    n = torch.arange(256)
    byte = torch.stack([(n + 64 * k) % 256 for k in range(4)], 1)  # [word, k]
    words = _as_int32((byte << (8 * torch.arange(4))).sum(1))
    thr = torch.arange(256, dtype=torch.int32).clamp(max=128)  # (a power of two of them)
    flags = torch.empty(256, 256, dtype=torch.int32, device=DEV)
    _flags_kernel[(1,)](words.to(DEV), thr.to(DEV), flags, NW=256, NT=256)
    flags = flags.cpu().to(torch.int64) % 2 ** 32  # [threshold, word]
    got = (flags[:, :, None] >> (8 * torch.arange(4) + 7)) & 1  # [threshold, word, k]
    want = (byte[None, :, :] % 128) >= thr[:, None, None]
    assert torch.equal(got.bool(), want)


@triton.jit
def _call_threshold_kernel(R, Theta, Out, N: tl.constexpr, NT: tl.constexpr):
    offs = tl.arange(0, N)
    r0, r1, r2, r3 = (tl.load(R + m * N + offs).to(tl.uint32, bitcast=True) for m in range(4))
    theta = tl.load(Theta + tl.arange(0, NT))[:, None]
    tw = _call_threshold(r0[None, :], r1[None, :], r2[None, :], r3[None, :], theta)
    tl.store(Out + tl.arange(0, NT)[:, None] * N + offs[None, :], tw.to(tl.int32, bitcast=True))


def test_call_threshold_is_t_plus_the_dither():
    """Each call's threshold is t = T + [s < F] (theta = 2^16 T + F), given as 128 - t in all
    four bytes, s the 16-bit number whose bit 4 k + m is bit 7 of byte k of word m: checked
    against that definition for random words and thetas with every T and extreme F."""
    g = torch.Generator().manual_seed(0)
    N = 256
    r = torch.randint(0, 2 ** 32, (4, N), generator=g)
    s = sum(((r[m] >> (8 * k + 7)) & 1) << (4 * k + m) for m in range(4) for k in range(4))
    T = torch.arange(128).repeat_interleave(4)
    F = torch.tensor([0, 1, 0x8000, 0xFFFF]).repeat(128)
    theta = (T << 16) | F
    out = torch.empty(theta.numel(), N, dtype=torch.int32, device=DEV)
    _call_threshold_kernel[(1,)](_as_int32(r).to(DEV), theta.to(torch.int32).to(DEV), out, N=N,
                                 NT=theta.numel())
    want = T[:, None] + (s[None, :] < F[:, None]).long()
    assert torch.equal(out.cpu().long() % 2 ** 32, (128 - want) * 0x01010101)
    assert (s < 0x8000).any() and (s >= 0x8000).any()


@triton.jit
def _apply_kernel(SEED, X, Out, Keep, Lq, i0, j0, thresh, BM: tl.constexpr, BN: tl.constexpr,
                  ASM: tl.constexpr):
    bh = tl.program_id(0)
    seed, off = load_dropout_seed(SEED)
    offs = bh * BM * BN + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    flags, sel = dropout_flags(seed, off, bh, i0, j0, Lq, thresh, BM, BN, ASM)
    tl.store(Out + offs, dropout_apply(tl.load(X + offs), flags, sel, ASM))
    # the reference mask: tl.philox and one compare per byte
    keep = dropout_keep(seed, off, bh, i0, j0, Lq, thresh, BM, BN)
    tl.store(Keep + offs, keep.to(tl.int8))


ASM_PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(
    DEV != "cuda", reason="the PTX path runs on the GPU only (the interpreter runs ASM=False)"))]


@pytest.mark.parametrize("asm", ASM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bm,bn,i0,j0", [(16, 16, 16, 48), (32, 64, 32, 64), (16, 32, 0, 96)])
def test_dropout_apply_zeroes_exactly_the_dropped_elements(asm, dtype, bm, bn, i0, j0):
    """The forward's mask (dropout_flags: four bytes compared at once; dropout_apply) keeps an
    element bit for bit or makes it +0, exactly where dropout_keep (one compare per byte, the
    backward's and dropout_keep_mask's form) drops it; on the GPU also the PTX path (Philox
    rounds by mul.wide, the prmt / and mask)."""
    B, H, Lq, Lk, p = 1, 3, 70, 130, 0.3
    torch.manual_seed(0)
    seed = draw_dropout_seed(DEV)
    x = torch.randn(B * H, bm, bn).to(dtype).to(DEV)
    x[0, 0, :4] = -0.0
    out = torch.empty_like(x)
    keep = torch.empty(B * H, bm, bn, dtype=torch.int8, device=DEV)
    _apply_kernel[(B * H,)](seed, x, out, keep, Lq, i0, j0, dropout_threshold(p), BM=bm, BN=bn,
                            ASM=asm)
    keep = keep.bool()
    rows, cols = min(bm, Lq - i0), bn
    want_keep = dropout_keep_block(seed, B, H, Lq, Lk, p, (i0, rows), (j0, cols))
    assert torch.equal(keep[:, :rows].cpu(), want_keep.reshape(B * H, rows, cols).cpu())
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    want = torch.where(keep, x, torch.zeros_like(x))
    assert torch.equal(out.view(bits).cpu(), want.view(bits).cpu())
    assert 0 < keep.float().mean() < 1


def test_mean_over_masks_approaches_undropped_output():
    """E[Z / (1 - p)] = 1, so the output averaged over independent masks converges to the
    undropped output. Many masks in few calls: the batch holds copies of one input (each copy
    its own (b, ...) counters), over a few seeds."""
    copies, Lq, Lk, H, D, p = 20, 7, 13, 1, 16, 0.3
    q, k, v, r, u, vb = make_inputs(1, Lq, Lk, H, D, device=DEV, seed=9)
    rep = [t.expand(copies, *t.shape[1:]) for t in (q, k, v)]
    samples = []
    for s in range(2):
        torch.manual_seed(100 + s)
        samples.append(rel_attention(*rep, r, u, vb, causal=True, dropout_p=p,
                                     backend="triton"))
    samples = torch.cat(samples).double()  # [N, Lq, H, D]
    want = rel_attention(q, k, v, r, u, vb, causal=True, backend="triton").double()[0]
    n = samples.shape[0]
    mean, std = samples.mean(0), samples.std(0)
    assert (std > 0).any()
    err = (mean - want).abs()
    assert torch.all(err <= 5 * std / math.sqrt(n) + 1e-5), (err / (std / math.sqrt(n))).max()
    # and the bound has teeth: the dropped output of one mask alone is outside it (for many
    # elements, not just one)
    outside = (samples[0] - want).abs() > 5 * std / math.sqrt(n) + 1e-5
    assert outside.float().mean() > 0.1, outside.float().mean()


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_uses_forward_mask_linearity_in_v(deterministic):
    """For a fixed seed out = A v with A = P Z / (1 - p): <dv, w> == <dout, A w> exactly."""
    B, Lq, Lk, H, D, p = 2, 13, 29, 2, 24, 0.35
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=4)
    w = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=5)[2]
    dout = torch.randn(B, Lq, H, D, generator=torch.Generator().manual_seed(6)).to(DEV)
    vg = v.clone().requires_grad_(True)
    torch.manual_seed(21)
    out = rel_attention(q, k, vg, r, u, vb, window_size=(15, 0), dropout_p=p,
                        backend="triton", deterministic=deterministic)
    dv, = torch.autograd.grad(out, vg, dout)
    torch.manual_seed(21)
    out_w = rel_attention(q, k, w, r, u, vb, window_size=(15, 0), dropout_p=p,
                          backend="triton")
    lhs = (dv.double() * w.double()).sum().item()
    rhs = (dout.double() * out_w.double()).sum().item()
    assert abs(lhs - rhs) <= 1e-5 * (abs(lhs) + 1.0), (lhs, rhs)
    # a different seed for the forward of w breaks the identity (the test can fail)
    torch.manual_seed(22)
    out_x = rel_attention(q, k, w, r, u, vb, window_size=(15, 0), dropout_p=p,
                          backend="triton")
    assert abs((dout.double() * out_x.double()).sum().item() - lhs) > 1e-3 * (abs(lhs) + 1.0)


def test_split_k_and_block_config_give_the_same_mask():
    B, Lq, Lk, H, D, p = 1, 21, 70, 2, 16, 0.25
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=7)
    seed = draw_dropout_seed(DEV)
    args = (q, k, v, r, u, vb, D ** -0.5, -1, 0)
    base, lse = rel_attn_fwd(*args, dropout_p=p, dropout_seed=seed, num_splits=1)
    keep = dropout_keep_mask(seed, B, H, Lq, Lk, p)
    want = rel_attention_reference(*args, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(base, want, rtol=1e-5, atol=1e-5)
    _, lse0 = rel_attn_fwd(*args)  # the lse is that of the undropped scores
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0)
    for kw in (dict(num_splits=3), dict(num_splits=2, config={"BLOCK_M": 16, "BLOCK_N": 32}),
               dict(config={"BLOCK_M": 32, "BLOCK_N": 16})):
        got, _ = rel_attn_fwd(*args, dropout_p=p, dropout_seed=seed, **kw)
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-6, msg=str(kw))


@pytest.mark.parametrize("D", [72, 160])
def test_forward_head_dims_over_64_use_the_same_mask(D):
    """The forward drops P with the word-at-a-time form up to head dim 128 (D 72: BLOCK_D
    128) and with the per-byte compare (dropout_keep) above (D 160: BLOCK_D 256): both give
    dropout_keep_mask's mask."""
    B, Lq, Lk, H, p = 1, 9, 40, 1, 0.3
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=12)
    seed = draw_dropout_seed(DEV)
    args = (q, k, v, r, u, vb, D ** -0.5, -1, 0)
    got, _ = rel_attn_fwd(*args, dropout_p=p, dropout_seed=seed)
    keep = dropout_keep_mask(seed, B, H, Lq, Lk, p)
    want = rel_attention_reference(*args, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reproducible_under_manual_seed_and_consecutive_calls_differ():
    ts = make_inputs(1, 9, 14, 2, 16, device=DEV, seed=8)
    torch.manual_seed(1234)
    a = rel_attention(*ts, causal=True, dropout_p=0.2, backend="triton")
    b = rel_attention(*ts, causal=True, dropout_p=0.2, backend="triton")
    torch.manual_seed(1234)
    a2 = rel_attention(*ts, causal=True, dropout_p=0.2, backend="triton")
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)
    # the state comes from the default generator of the tensors' device
    torch.manual_seed(1234)
    s1 = draw_dropout_seed(DEV)
    torch.manual_seed(1234)
    assert torch.equal(draw_dropout_seed(DEV), s1)
    assert s1.dtype == torch.int64 and s1.shape == (2,) and s1.device.type == DEV


@pytest.fixture
def fused_calls(monkeypatch):
    """dropout_p of every call that reached the fused op."""
    seen = []
    real = txl_kernels._op.rel_attn_func

    def wrapper(*args, **kwargs):
        seen.append(args[13] if len(args) > 13 else kwargs.get("dropout_p", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(txl_kernels._op, "rel_attn_func", wrapper)
    return seen


def test_fused_rel_attention_module_routes_dropout_to_fused_kernel(fused_calls):
    torch.manual_seed(0)
    model = FusedRelAttention(2, 32, 16, 0.0, dropatt=0.2, untie_r=True, mask_mode="causal",
                              backend="auto")
    g = torch.Generator().manual_seed(1)
    w, mems, r = (torch.randn(*s, generator=g).to(DEV) for s in ((6, 2, 32), (4, 2, 32),
                                                                  (10, 1, 32)))
    model = model.to(DEV).train()
    torch.manual_seed(5)
    a = model(w, r, mems=mems)
    a.square().mean().backward()
    torch.manual_seed(5)
    a2 = model(w, r, mems=mems)
    model.eval()
    b = model(w, r, mems=mems)
    c = model(w, r, mems=mems)
    assert fused_calls == [0.2, 0.2, 0.0, 0.0]
    assert torch.equal(a, a2) and torch.equal(b, c) and not torch.allclose(a, b)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("cls", ["nemo", "espnet"])
def test_conformer_modules_route_dropout_to_fused_kernel(cls, fused_calls):
    B, T, n_feat = 2, 6, 32
    torch.manual_seed(0)
    if cls == "nemo":
        mod = NeMoRelPositionMultiHeadAttention(2, n_feat, 0.25, None, None, backend="auto")
    else:
        mod = ESPnetRelPositionMultiHeadedAttention(2, n_feat, 0.25, backend="auto")
    mod = mod.to(DEV)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, n_feat, generator=g).to(DEV)
    pe = torch.randn(1, 2 * T - 1, n_feat, generator=g).to(DEV)

    def run():
        if cls == "nemo":
            return mod(query=x, key=x, value=x, mask=None, pos_emb=pe)
        return mod(x, x, x, pe)

    mod.train()
    a = run()
    mod.eval()
    b = run()
    assert fused_calls == [0.25, 0.0]
    assert not torch.allclose(a, b)


def test_opcheck_with_dropout():
    """Both ops with dropout_p and the (seed, offset) tensor: schema, fake tensors, autograd
    registration (the forward op's own backward goes through the backward op)."""
    B, Lq, Lk, H, D = 1, 5, 9, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, requires_grad=True)
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=DEV)
    kpm[0, 1] = True
    seed = draw_dropout_seed(DEV)
    args = (q, k, v, r, u, vb, D ** -0.5, -1, 0, kpm, None, None, 0.3, seed)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_functional_with_dropout():
    ts = make_inputs(2, 7, 11, 2, 16, device=DEV, seed=3, requires_grad=True)

    def f(q, k, v, r, u, vb):
        return rel_attention(q, k, v, r, u, vb, window_size=(5, 0), dropout_p=0.3,
                             backend="triton") * 2

    backend = "inductor" if DEV == "cuda" else "aot_eager"
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch.manual_seed(3)
    want = f(*ts)
    gw = torch.autograd.grad(want.sum(), ts)
    torch.manual_seed(3)
    got = compiled(*ts)
    gg = torch.autograd.grad(got.sum(), ts)
    if DEV != "cuda":  # aot_eager draws the same seed as eager
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.equal(compiled(*ts), got)  # a new mask per call
