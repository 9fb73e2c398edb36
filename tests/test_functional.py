"""rel_attention's contract: argument checks (each names the argument), backend dispatch,
position-row checks, strided inputs."""
import pytest
import torch

import txl_kernels
from txl_kernels import rel_attention

from helpers import make_inputs


def _inputs(**kw):
    return make_inputs(2, 5, 8, 2, 16, **kw)


def _call(*ts, **kw):
    kw.setdefault("backend", "reference")
    return rel_attention(*ts, **kw)


BAD = [
    # (description, mutation of args list / kwargs, exception, text that must appear)
    ("q rank", lambda a, kw: a.__setitem__(0, a[0][0]), ValueError, "q must be 4-D"),
    ("k rank", lambda a, kw: a.__setitem__(1, a[1][0]), ValueError, "k must be 4-D"),
    ("r rank", lambda a, kw: a.__setitem__(3, a[3][0]), ValueError, "r must be 3-D"),
    ("u rank", lambda a, kw: a.__setitem__(4, a[4][None]), ValueError, "r_w_bias must be 2-D"),
    ("q not tensor", lambda a, kw: a.__setitem__(0, 1.0), TypeError, "q must be a torch.Tensor"),
    ("int dtype", lambda a, kw: a.__setitem__(2, a[2].long()), TypeError, "v must be float16"),
    ("dtype mismatch", lambda a, kw: a.__setitem__(1, a[1].double()), TypeError, "k has dtype torch.float64"),
    ("k heads", lambda a, kw: a.__setitem__(1, a[1][:, :, :1]), ValueError, "k must be [B, Lk, H, D]"),
    ("v shape", lambda a, kw: a.__setitem__(2, a[2][:, :-1]), ValueError, "v must have k's shape"),
    ("Lk < Lq", lambda a, kw: (a.__setitem__(1, a[1][:, :3]), a.__setitem__(2, a[2][:, :3])), ValueError, "Lk >= Lq"),
    ("r head dim", lambda a, kw: a.__setitem__(3, a[3][..., :-1]), ValueError, "r must be [R, H, D]"),
    ("vb shape", lambda a, kw: a.__setitem__(5, a[5][:1]), ValueError, "r_r_bias must be [H, D]"),
    ("window type", lambda a, kw: kw.update(window_size=3), TypeError, "window_size"),
    ("window value", lambda a, kw: kw.update(window_size=(-2, 0)), ValueError, "window_size"),
    ("window > int64", lambda a, kw: kw.update(window_size=(2 ** 63, 0)), ValueError, "window_size entries must fit in int64"),
    ("causal type", lambda a, kw: kw.update(causal=1), TypeError, "causal"),
    ("kpm dtype", lambda a, kw: kw.update(key_padding_mask=torch.zeros(2, 8)), TypeError, "key_padding_mask must have dtype torch.bool"),
    ("kpm shape", lambda a, kw: kw.update(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
    ("mask dtype", lambda a, kw: kw.update(attn_mask=torch.zeros(5, 8, dtype=torch.uint8)), TypeError, "attn_mask must have dtype torch.bool"),
    ("mask shape", lambda a, kw: kw.update(attn_mask=torch.zeros(5, 7, dtype=torch.bool)), ValueError, "attn_mask must be broadcastable"),
    ("mask rank", lambda a, kw: kw.update(attn_mask=torch.zeros(1, 2, 2, 5, 8, dtype=torch.bool)), ValueError, "attn_mask must be broadcastable"),
    ("scale type", lambda a, kw: kw.update(softmax_scale="x"), TypeError, "softmax_scale"),
    ("dropout", lambda a, kw: kw.update(dropout_p=1.5), ValueError, "dropout_p"),
    ("backend", lambda a, kw: kw.update(backend="cuda"), ValueError, "backend must be one of"),
    ("r too short", lambda a, kw: a.__setitem__(3, a[3][:4]), ValueError, "r has 4 rows"),
    ("r short, non-causal", lambda a, kw: kw.update(causal=False), ValueError, "need rows 0..11"),
]


@pytest.mark.parametrize("desc,mutate,exc,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input(desc, mutate, exc, text):
    args, kw = list(_inputs()), {}
    mutate(args, kw)
    with pytest.raises(exc, match=pytest.importorskip("re").escape(text)):
        _call(*args, **kw)


def test_error_message_says_what_came():
    q, k, v, r, u, vb = _inputs()
    with pytest.raises(ValueError) as e:
        _call(q[0], k, v, r, u, vb)
    assert "shape [5, 2, 16]" in str(e.value) and "dtype torch.float32" in str(e.value)


def test_device_mismatch():
    q, k, v, r, u, vb = _inputs()
    meta = k.to("meta")
    with pytest.raises(ValueError, match="k is on meta"):
        _call(q, meta, v, r, u, vb)


def test_position_rows_error_names_rows_and_window_fixes_it():
    q, k, v, r, u, vb = make_inputs(1, 4, 4, 1, 16, R=4)
    with pytest.raises(ValueError, match=r"need rows 0\.\.6"):
        _call(q, k, v, r, u, vb, causal=False)
    # a right window of 0 (== causal) only needs rows 0..3
    _call(q, k, v, r, u, vb, causal=False, window_size=(-1, 0))


def test_seq_first_views_match_batch_first():
    bf = make_inputs(2, 6, 9, 2, 16, layout="bshd", seed=3)
    # same numbers, seq-first storage
    sf = [t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 4 else t for t in bf]
    assert not sf[0].is_contiguous() and sf[0].stride(-1) == 1
    torch.testing.assert_close(_call(*sf), _call(*bf))


def test_broadcast_attn_mask_equals_full():
    q, k, v, r, u, vb = _inputs()
    m2 = torch.rand(5, 8) < 0.3
    full = m2.expand(2, 2, 5, 8).contiguous()
    torch.testing.assert_close(_call(q, k, v, r, u, vb, attn_mask=m2),
                               _call(q, k, v, r, u, vb, attn_mask=full), rtol=0, atol=0)


def test_causal_is_window_right_zero():
    ts = _inputs()
    torch.testing.assert_close(_call(*ts, causal=True),
                               _call(*ts, causal=False, window_size=(-1, 0)), rtol=0, atol=0)


def _no_interpreter(monkeypatch):
    """As in a process that never set TRITON_INTERPRET: once the kernels exist, what triton
    built decides (``_utils.interpreting``), so the variable alone cannot switch it off here."""
    import txl_kernels.functional as F
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(F, "interpreting", lambda: False)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    _no_interpreter(monkeypatch)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _call(*_inputs(), backend="triton")


def test_triton_backend_rejects_unsupported_head_dim():
    q, k, v, r, u, vb = make_inputs(1, 3, 3, 1, 8)
    with pytest.raises(ValueError, match="head dims 16..256"):
        _call(q, k, v, r, u, vb, backend="triton")


def test_auto_falls_back_to_reference_on_cpu_without_interpreter(monkeypatch):
    """Without the interpreter and without the C++ CPU kernel (which "auto" takes where it is
    built: tests/test_cpu_kernel.py)."""
    import txl_kernels._cpp_ops
    import txl_kernels.cpu_kernel
    _no_interpreter(monkeypatch)
    monkeypatch.setattr(txl_kernels.cpu_kernel, "_STATE", (False, "not built"))
    monkeypatch.setattr(txl_kernels._cpp_ops, "_WARNED", {"cpu"})  # its warning already given
    ts = _inputs()
    torch.testing.assert_close(_call(*ts, backend="auto"), _call(*ts), rtol=0, atol=0)
    ok, why = txl_kernels.fused_available(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in why


def test_dropout_runs_fused_path():
    """dropout_p > 0 on backend="triton" runs the fused kernels (it used to fall back to the
    reference path): the result is the reference with the kernels' keep-mask, not F.dropout's."""
    from txl_kernels.ops.rel_attn_fwd import draw_dropout_seed, dropout_keep_mask
    from txl_kernels.reference import rel_attention_reference

    ts = _inputs()
    torch.manual_seed(0)
    a = _call(*ts, dropout_p=0.3, backend="triton")
    torch.manual_seed(0)
    b = _call(*ts, dropout_p=0.3, backend="reference")
    torch.manual_seed(0)
    keep = dropout_keep_mask(draw_dropout_seed("cpu"), 2, 2, 5, 8, 0.3)
    want = rel_attention_reference(*ts, 16 ** -0.5, -1, 0, dropout_p=0.3, dropout_mask=keep)
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, _call(*ts))


@pytest.mark.parametrize("window", [(0, 2 ** 31 - 1), (2 ** 31 - 1, 2 ** 31), (3, 2 ** 62)])
def test_huge_windows_are_clamped_to_the_shapes(window):
    """Regression: window bounds past int32 overflowed the fused kernels' index arithmetic
    (off by up to 3.35). A bound past the shapes' distances is the unbounded side."""
    from helpers import FUSED_DEVICE
    want_window = tuple(-1 if w > 2 ** 20 else w for w in window)
    res = []
    for backend, win in (("triton", window), ("reference", want_window)):
        ts = make_inputs(1, 6, 11, 2, 16, R=16, device=FUSED_DEVICE, seed=3, requires_grad=True)
        out = rel_attention(*ts, causal=False, window_size=win, backend=backend)
        out.backward(torch.ones_like(out))
        res.append([out.detach()] + [t.grad for t in ts])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_causal_accepts_numpy_bools_and_names_other_types():
    """Regression: causal=np.bool_(True) gave "must be a bool, got bool"."""
    np = pytest.importorskip("numpy")
    ts = _inputs(R=12)
    for flag in (True, False):
        torch.testing.assert_close(_call(*ts, causal=np.bool_(flag), window_size=(-1, -1)),
                                   _call(*ts, causal=flag, window_size=(-1, -1)))
    with pytest.raises(TypeError, match=r"causal must be a bool .*got numpy\.int64"):
        _call(*ts, causal=np.int64(1))
    with pytest.raises(TypeError, match=r"causal must be a bool .*got torch\.Tensor"):
        _call(*ts, causal=torch.tensor(True))


def _dense_attention(q, k, v, r, u, vb, scale, allowed):
    """The contract's formula written out in float64 with a dense [B, H, Lq, Lk] allowed mask
    (no shared code with the backends)."""
    Lq, Lk = q.shape[1], k.shape[1]
    p = torch.arange(Lk)[None, :] - torch.arange(Lq)[:, None] + Lq - 1  # row of r per pair
    ac = torch.einsum("bihd,bjhd->bhij", q + u, k)
    rr = r[p.clamp(0, r.shape[0] - 1)]  # [Lq, Lk, H, D]
    bd = torch.einsum("bihd,ijhd->bhij", q + vb, rr)
    s = ((ac + bd) * scale).masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", w, v)


@pytest.mark.parametrize("scale", [-0.37, 0.0])
@pytest.mark.parametrize("mask", ["causal", "padding"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_any_finite_softmax_scale(scale, mask, backend):
    """Regression: the fused forward gave NaN for softmax_scale <= 0 on every row with a masked
    pair in its tile (its running maximum assumed a positive scale). Forward and every gradient
    against the written-out formula, with Lk not a multiple of the tile."""
    from helpers import FUSED_DEVICE
    B, Lq, Lk, H, D = 2, 5, 9, 2, 16
    ts = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, device=FUSED_DEVICE, seed=4,
                     requires_grad=True)
    i = torch.arange(Lq)[:, None] + Lk - Lq
    j = torch.arange(Lk)[None, :]
    if mask == "causal":
        kw = {"causal": True}
        allowed = (j <= i).expand(B, H, Lq, Lk)
    else:
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, -3:] = True
        kw = {"causal": False, "key_padding_mask": kpm.to(FUSED_DEVICE)}
        allowed = (~kpm)[:, None, None, :].expand(B, H, Lq, Lk)
    out = rel_attention(*ts, softmax_scale=scale, backend=backend, **kw)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad((out * w).sum(), ts)
    ts64 = [t.detach().cpu().double().requires_grad_() for t in ts]
    want = _dense_attention(*ts64, scale, allowed)
    want_grads = torch.autograd.grad((want * w.cpu().double()).sum(), ts64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-4, atol=1e-5)
    for name, g, gw in zip(("q", "k", "v", "r", "u", "vb"), grads, want_grads):
        torch.testing.assert_close(g.cpu().double(), gw, rtol=1e-4, atol=1e-5, msg=name)
    if scale == 0.0:  # uniform weights over the allowed keys
        mean = (v_ := ts64[2].detach()).new_zeros(B, Lq, H, D)
        for b in range(B):
            mean[b] = v_[b][allowed[b, 0, -1]].mean(0)
        torch.testing.assert_close(out[:, -1].cpu().double(), mean[:, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_non_finite_softmax_scale_raises(scale, backend):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite float, got (nan|-?inf)"):
        _call(*_inputs(), softmax_scale=scale, backend=backend)


def test_fused_forward_launcher_refuses_non_positive_scale():
    """The launcher behind rel_attention (and the registered op) is only right for scale > 0:
    a direct call with another scale raises instead of returning NaN rows."""
    from txl_kernels.ops.rel_attn_fwd import rel_attn_fwd
    q, k, v, r, u, vb = _inputs()
    for bad in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
            rel_attn_fwd(q, k, v, r, u, vb, bad, -1, 0)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
@pytest.mark.parametrize("window_left", [-1, 3])
def test_decode_kernel_any_finite_scale(scale, window_left):
    """The split-K decode kernel (one query row) scales before it masks: right for any finite
    scale, zero and negative included."""
    from helpers import FUSED_DEVICE
    from txl_kernels.ops.rel_attn_decode import rel_attn_decode
    B, Lk, H, D = 2, 11, 2, 16
    q, k, v, r, u, vb = make_inputs(B, 1, Lk, H, D, device=FUSED_DEVICE, seed=6)
    got = rel_attn_decode(q, k, v, r, u, vb, scale, window_left, num_splits=2)
    j = torch.arange(Lk)
    allowed = (j >= (Lk - 1 - window_left if window_left >= 0 else 0)).expand(B, H, 1, Lk)
    want = _dense_attention(*(t.cpu().double() for t in (q, k, v, r, u, vb)), scale, allowed)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-6)
