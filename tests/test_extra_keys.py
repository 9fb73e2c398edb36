"""rel_attention's extra keys (extra_q / extra_k / extra_v): G more keys every query attends with
a plain dot-product score, in the same softmax as the relative scores. Checked against a dense
float64 oracle written here, on every backend, forward and every gradient; the fused backends
merge the kernel's (out, lse) with the extra part and form nothing Lq x Lk, also with
dropout."""
import pytest
import torch

import txl_kernels.reference as reference_mod
from txl_kernels import rel_attention
from txl_kernels.quant import quantize_kv

from helpers import FUSED_DEVICE, assert_within

B, LQ, H, D, G = 2, 9, 2, 16, 3


def dense_oracle(q, k, v, r, u, vb, eq, ek, ev, scale, wl, wr, kpm):
    """The joint softmax written out: relative scores over the allowed (window, padding) keys,
    then the G extra columns ``scale * eq . ek``."""
    lq, lk = q.shape[1], k.shape[1]
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    d = i - j
    rows = r[(j - i + (lq - 1) + (lk - lq)).clamp(0, r.shape[0] - 1)]  # [Lq, Lk, H, D]
    ac = torch.einsum("bihd,bjhd->bhij", q + u, k)
    bd = torch.einsum("bihd,ijhd->bhij", q + vb, rows)
    s = (ac + bd) * scale
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if wl >= 0:
        allowed &= d <= wl
    if wr >= 0:
        allowed &= -d <= wr
    allowed = allowed[None, None] & ~kpm[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    se = torch.einsum("bihd,bghd->bhig", eq, ek) * scale
    p = torch.softmax(torch.cat([s, se], -1), -1)
    return (torch.einsum("bhij,bjhd->bihd", p[..., :lk], v)
            + torch.einsum("bhig,bghd->bihd", p[..., lk:], ev))


def inputs(dtype, lk=LQ, g=G, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    ts = [rnd(B, LQ, H, D), rnd(B, lk, H, D), rnd(B, lk, H, D), rnd(lk + LQ - 1, H, D),
          rnd(H, D), rnd(H, D), rnd(B, LQ, H, D), rnd(B, g, H, D), rnd(B, g, H, D)]
    kpm = torch.zeros(B, lk, dtype=torch.bool)
    kpm[1, lk - 3:] = True
    return ts, kpm


def run(ts, kpm, backend, window, device="cpu", default_q=False, dropout_p=0.0):
    ts = [t.detach().to(device).requires_grad_() for t in ts]
    q, k, v, r, u, vb, eq, ek, ev = ts
    extra = dict(extra_k=ek, extra_v=ev) if default_q else dict(extra_q=eq, extra_k=ek,
                                                                 extra_v=ev)
    out = rel_attention(q, k, v, r, u, vb, causal=False, window_size=window,
                        key_padding_mask=kpm.to(device), softmax_scale=0.3, backend=backend,
                        dropout_p=dropout_p, **extra)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(out)
    grads = torch.autograd.grad((out * dout).sum(), [t for t in ts if t.requires_grad],
                                allow_unused=True)
    return out, grads


def truth(ts, kpm, window, default_q=False):
    up = [t.detach().double().requires_grad_() for t in ts]
    q, k, v, r, u, vb, eq, ek, ev = up
    out = dense_oracle(q, k, v, r, u, vb, q if default_q else eq, ek, ev, 0.3, *window, kpm)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64)
    return out, torch.autograd.grad((out * dout).sum(), up, allow_unused=True)


NAMES = ["q", "k", "v", "r", "r_w_bias", "r_r_bias", "extra_q", "extra_k", "extra_v"]


@pytest.mark.parametrize("window", [(-1, -1), (3, 2), (0, 4)])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_extra_keys_match_dense_oracle_float64(backend, window):
    ts, kpm = inputs(torch.float64, lk=LQ + 2)
    out, grads = run(ts, kpm, backend, window)
    t_out, t_grads = truth(ts, kpm, window)
    torch.testing.assert_close(out, t_out, rtol=1e-10, atol=1e-11)
    for name, a, b in zip(NAMES, grads, t_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_extra_keys_default_query_is_q(backend):
    """Without extra_q the extra keys are scored by q (no bias); q's gradient has both parts."""
    dtype = torch.float64 if backend != "triton" else torch.float32
    ts, kpm = inputs(dtype)
    device = FUSED_DEVICE if backend == "triton" else "cpu"
    out, grads = run(ts, kpm, backend, (2, 2), device=device, default_q=True)
    same, same_grads = run(ts, kpm, "reference", (2, 2), default_q=True)
    t_out, t_grads = truth(ts, kpm, (2, 2), default_q=True)
    assert grads[6] is None
    for name, a, b, c in zip(["out"] + NAMES, (out,) + grads, (same,) + same_grads,
                             (t_out,) + t_grads):
        if name == "extra_q":
            continue
        if dtype == torch.float64:
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-11)
        else:
            assert_within(name, a.detach().cpu(), b.detach(), c)


@pytest.mark.parametrize("window", [(-1, -1), (3, 1)])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_extra_keys_fused_float32_form_no_score_matrix(monkeypatch, backend, window):
    """The fused backends: float32 as close to the float64 truth as the reference path in
    float32, and the reference (the only code that forms Lq x Lk scores) is never called."""
    ts, kpm = inputs(torch.float32, lk=LQ + 3)
    ref_out, ref_grads = run(ts, kpm, "reference", window)
    t_out, t_grads = truth(ts, kpm, window)

    def no_reference(*args, **kwargs):
        raise AssertionError("the fused path called the reference")

    monkeypatch.setattr(reference_mod, "_rel_attention_reference", no_reference)
    device = FUSED_DEVICE if backend == "triton" else "cpu"
    out, grads = run(ts, kpm, backend, window, device=device)
    assert_within("out", out.detach().cpu(), ref_out.detach(), t_out.detach())
    for name, a, b, c in zip(NAMES, grads, ref_grads, t_grads):
        assert_within(name, a.cpu(), b, c)


@pytest.mark.parametrize("leaf", [True, False])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_extra_keys_sliced_from_k_and_v(backend, leaf):
    """Extra keys / values that are row slices of k / v (NeMo's global tokens: ``k[:, 0:G s:s]``):
    the gradients of k and v hold both parts (the fused path adds the slices' part into dk /
    dv in place); a slice of a detached k adds nothing to k's gradient."""
    ts, kpm = inputs(torch.float64, lk=LQ + 4)
    base = [t.detach().requires_grad_() for t in ts[:6]]
    cases = (lambda k, v: (k[:, 1:8:3], v[:, 0:6:2]),
             lambda k, v: (k.detach()[:, 2:5], v[:, 4:7]))
    for pick in cases:
        q, k, v, r, u, vb = base if leaf else [t * 1 for t in base]
        ek, ev = pick(k, v)
        out = rel_attention(q, k, v, r, u, vb, causal=False, window_size=(3, 2),
                            key_padding_mask=kpm, softmax_scale=0.3, backend=backend,
                            extra_k=ek, extra_v=ev)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                           dtype=torch.float64)
        grads = torch.autograd.grad((out * dout).sum(), base)
        up = [t.detach().requires_grad_() for t in ts[:6]]
        t_out = dense_oracle(*up, up[0], *pick(up[1], up[2]), 0.3, 3, 2, kpm)
        t_grads = torch.autograd.grad((t_out * dout).sum(), up)
        torch.testing.assert_close(out, t_out, rtol=1e-10, atol=1e-11)
        for name, a, b in zip(NAMES, grads, t_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11,
                                       msg=lambda m: f"{name}: {m}")


def test_extra_keys_sliced_from_k_and_v_triton():
    """The same on the Triton kernels (float32): k's and v's gradients hold the slices' part
    (added into dk / dv in place), as close to the float64 truth as the reference in float32."""
    ts, kpm = inputs(torch.float32, lk=LQ + 4)

    def grads_of(backend, dtype, device):
        base = [t.detach().to(device, dtype).requires_grad_() for t in ts[:6]]
        q, k, v, r, u, vb = [t * 1 for t in base]
        out = rel_attention(q, k, v, r, u, vb, causal=False, window_size=(3, 2),
                            key_padding_mask=kpm.to(device), softmax_scale=0.3,
                            backend=backend, extra_k=k[:, 1:8:3], extra_v=v[:, 0:6:2])
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                           dtype=torch.float64).to(out)
        return [out.detach().cpu()] + [g.cpu() for g in
                                       torch.autograd.grad((out * dout).sum(), base)]

    got = grads_of("triton", torch.float32, FUSED_DEVICE)
    ref = grads_of("reference", torch.float32, "cpu")
    truth = grads_of("reference", torch.float64, "cpu")
    for name, a, b, c in zip(["out"] + NAMES[:6], got, ref, truth):
        assert_within(name, a, b, c)


def test_extra_keys_rows_without_relative_keys_attend_extra_only():
    """A query whose relative keys are all padded still has the extra keys: its output is
    their softmax-weighted values (not 0), on the fused CPU kernel as on the reference."""
    ts, kpm = inputs(torch.float64)
    kpm[0] = True
    for backend in ("reference", "cpu"):
        out, _ = run(ts, kpm, backend, (-1, -1))
        t_out, _ = truth(ts, kpm, (-1, -1))
        torch.testing.assert_close(out, t_out, rtol=1e-10, atol=1e-11)
        assert out[0].abs().min() > 0 or out[0].abs().sum() > 0


def test_extra_keys_bad_arguments_raise_clear_errors():
    (q, k, v, r, u, vb, eq, ek, ev), _ = inputs(torch.float32)
    call = dict(causal=False, backend="reference")
    with pytest.raises(ValueError, match="extra_k and extra_v must be given together"):
        rel_attention(q, k, v, r, u, vb, extra_k=ek, **call)
    with pytest.raises(ValueError, match="extra_q scores the extra keys"):
        rel_attention(q, k, v, r, u, vb, extra_q=eq, **call)
    with pytest.raises(ValueError, match=r"extra_k must be \[B, G, H, D\]"):
        rel_attention(q, k, v, r, u, vb, extra_k=ek[:, :, :1], extra_v=ev, **call)
    with pytest.raises(ValueError, match="extra_v must have extra_k's shape"):
        rel_attention(q, k, v, r, u, vb, extra_k=ek, extra_v=ev[:, :1], **call)
    with pytest.raises(ValueError, match="extra_q must have q's shape"):
        rel_attention(q, k, v, r, u, vb, extra_q=eq[:, :2], extra_k=ek, extra_v=ev, **call)
    with pytest.raises(TypeError, match="extra_v must be float16"):
        rel_attention(q, k, v, r, u, vb, extra_k=ek, extra_v=ev.long(), **call)
    mem = quantize_kv(k[:, :2], v[:, :2], torch.int8)
    with pytest.raises(ValueError, match="not supported with memory"):
        rel_attention(q, k, v, r, u, vb, extra_k=ek, extra_v=ev, memory=mem, **call)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_extra_keys_dropout_on_fused_kernels(backend):
    """dropout_p > 0 on the fused backends: the kernels drop the relative part with their
    keep-mask (from the (seed, offset) pair drawn first), the extra part with torch.rand drawn
    next; the reference with those two masks gives the same output and gradients."""
    from txl_kernels.ops.rel_attn_fwd import dropout_keep_mask

    p = 0.25  # a multiple of 2^-23: the kernels drop with exactly this rate
    dtype = torch.float32 if backend == "triton" else torch.float64
    device = FUSED_DEVICE if backend == "triton" else "cpu"
    ts, kpm = inputs(dtype)
    run(ts, kpm, backend, (3, 2), device=device, dropout_p=p)  # first use: self-checks
    torch.manual_seed(3)
    out, grads = run(ts, kpm, backend, (3, 2), device=device, dropout_p=p)
    torch.manual_seed(3)
    seed = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)
    keep_extra = torch.rand((B, H, LQ, G), device=device) >= p
    keep = torch.cat([dropout_keep_mask(seed, B, H, LQ, LQ, p).cpu(), keep_extra.cpu()], -1)
    assert 0 < keep.float().mean() < 1
    up = [t.detach().double().requires_grad_() for t in ts]
    want = reference_mod.rel_attention_reference(*up[:6], 0.3, 3, 2, kpm, None, p,
                                                 dropout_mask=keep, extra=tuple(up[6:]))
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64)
    want_grads = torch.autograd.grad((want * dout).sum(), up)
    tol = dict(rtol=1e-10, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    for name, a, b in zip(NAMES, grads, want_grads):
        torch.testing.assert_close(a.double().cpu(), b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_extra_keys_with_short_position_table(backend):
    """With r_first_distance the band reads a table of left + right + 1 rows; the extra keys
    merge with it on every backend (forward and every gradient)."""
    left, right = 3, 2
    dtype = torch.float32 if backend == "triton" else torch.float64
    ts, kpm = inputs(dtype)
    r_short = ts[3][:left + right + 1]
    full = torch.zeros_like(ts[3])  # row p = distance Lk - 1 - p (Lk = Lq here)
    full[LQ - 1 - left:LQ + right] = r_short
    device = FUSED_DEVICE if backend == "triton" else "cpu"
    short_ts = [t.detach().to(device).requires_grad_() for t in ts[:3] + [r_short] + ts[4:]]
    q, k, v, r, u, vb, eq, ek, ev = short_ts
    out = rel_attention(q, k, v, r, u, vb, causal=False, window_size=(left, right),
                        key_padding_mask=kpm.to(device), softmax_scale=0.3, backend=backend,
                        r_first_distance=left, extra_q=eq, extra_k=ek, extra_v=ev)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64)
    grads = torch.autograd.grad((out.double().cpu() * dout).sum(), short_ts)
    t_out, t_grads = truth(ts[:3] + [full] + ts[4:], kpm, (left, right))
    t_grads = list(t_grads)
    t_grads[3] = t_grads[3][LQ - 1 - left:LQ + right]
    tol = dict(rtol=1e-10, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(out.double().cpu(), t_out, **tol)
    for name, a, b in zip(NAMES, grads, t_grads):
        torch.testing.assert_close(a.double().cpu(), b, **tol, msg=lambda m: f"{name}: {m}")
