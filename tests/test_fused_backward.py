"""Fused Triton backward (txl_kernels/ops/rel_attn_bwd.py): every gradient (q, k, v, r,
r_w_bias, r_r_bias) against torch autograd of the float64 reference, with PyTorch's same math in
the same precision as the yardstick (tests/helpers.py ``assert_within``).

The kernels are fed the ``(out, lse)`` an exact forward would save (``_forward_outputs``, the
reference math in float64, checked against ``rel_attention_reference(..., return_lse=True)``),
so these tests do not depend on the fused forward; the end-to-end tests at the bottom go through
``rel_attention(..., backend="triton")`` and ``.backward()``.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py) and on the GPU when there is one.
"""
import pytest
import torch

import txl_kernels
from txl_kernels.ops.rel_attn_bwd import rel_attn_bwd
from txl_kernels.reference import allowed_pairs, rel_attention_reference, rel_shift

from helpers import FUSED_DEVICE, FUSED_DTYPES, assert_within, make_inputs, oracle, requires_cuda

NAMES = ("dq", "dk", "dv", "dr", "du", "dvb")


def _rand_like_out(B, Lq, H, D, dtype, seed=123):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Lq, H, D, generator=g).to(dtype).to(FUSED_DEVICE)


def _forward_outputs(ts, scale, wl, wr, kpm=None, mask=None):
    """(out, lse) as an exact fused forward saves them: q + u and q + vb rounded to the input
    dtype (the tensor-core operands; torch's `q + u` in that dtype rounds the same way), every
    product and the softmax in float64, out rounded to the input dtype, lse in fp32 (+inf on
    rows with no allowed key). The same-precision reference is not used here: it rounds its
    fp16 / bf16 score products to the input dtype, so its lse does not match the
    fp32-accumulated scores that the kernels recompute."""
    q, k, v, r, u, vb = (t.detach() for t in ts)
    Lq, Lk = q.shape[1], k.shape[1]
    a, qv = (q + u).double(), (q + vb).double()
    ac = torch.einsum("bihd,bjhd->bhij", a, k.double())
    bd = rel_shift(torch.einsum("bihd,phd->bhip", qv, r.double()), Lk)
    allowed = allowed_pairs(Lq, Lk, wl, wr, kpm, mask, q.device)
    s = ((ac + bd) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.where(empty[..., None], 0.0, torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]))
    out = torch.einsum("bhij,bjhd->bihd", p, v.double())
    return out.to(q.dtype), lse.masked_fill(empty, float("inf")).float()


def _run(ts, scale, wl, wr, kpm=None, mask=None, do=None, **kw):
    """Returns (fused grads, same-precision autograd grads, float64 autograd grads)."""
    q, k, v, r, u, vb = ts
    B, Lq, H, D = q.shape
    if do is None:
        do = _rand_like_out(B, Lq, H, D, q.dtype)
    out, lse = _forward_outputs(ts, scale, wl, wr, kpm, mask)
    fused = rel_attn_bwd(do, q.detach(), k.detach(), v.detach(), r.detach(), u.detach(),
                         vb.detach(), out, lse, scale, wl, wr, kpm, mask, **kw)
    same = torch.autograd.grad(
        rel_attention_reference(q, k, v, r, u, vb, scale, wl, wr, kpm, mask), ts, do)
    up, o64 = oracle(q, k, v, r, u, vb, scale, wl, wr, kpm, mask)
    truth = torch.autograd.grad(o64, up, do.double())
    return fused, same, truth


def _check(ts, scale, wl, wr, kpm=None, mask=None, **kw):
    fused, same, truth = _run(ts, scale, wl, wr, kpm, mask, **kw)
    for name, got, sp, tr, inp in zip(NAMES, fused, same, truth, ts):
        assert got.shape == inp.shape, f"{name}: shape {tuple(got.shape)} != {tuple(inp.shape)}"
        assert got.dtype == inp.dtype, f"{name}: dtype {got.dtype} != {inp.dtype}"
        assert got.is_contiguous(), f"{name} is not contiguous"
        assert_within(name, got, sp, tr)
    return fused


def _inputs(B, Lq, Lk, H, D, R=None, dtype=torch.float32, layout="bshd", seed=0):
    return make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, device=FUSED_DEVICE, layout=layout,
                       seed=seed, requires_grad=True)


def test_forward_outputs_match_reference():
    """The test-side forward emulation equals the reference's (out, lse) on float64 inputs."""
    B, Lq, Lk, H, D = 2, 9, 14, 2, 16
    ts = make_inputs(B, Lq, Lk, H, D, R=Lq + Lk - 1, dtype=torch.float64, seed=40)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[1] = True  # every row of batch 1 fully masked
    mask = torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(40)) < 0.3
    for wl, wr in ((-1, 0), (4, 2), (-1, -1)):
        out, lse = _forward_outputs(ts, 0.3, wl, wr, kpm, mask)
        ref_out, ref_lse = rel_attention_reference(*ts, 0.3, wl, wr, kpm, mask, return_lse=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=0.0)


# --------------------------------------------------------------------------------------------
# Causal with memory, lengths and head dims, dtypes, layouts
# --------------------------------------------------------------------------------------------

# (B, Lq, Lk, H, D): mlen 0, mlen < Lq, mlen > Lq, Lq 1, Lq 64, head dims 16 / 41 / 64
CAUSAL_SHAPES = [
    (2, 37, 37, 2, 16),    # mlen = 0
    (2, 37, 50, 2, 41),    # mlen < Lq
    (1, 37, 150, 2, 16),   # mlen > Lq
    (2, 1, 20, 2, 41),     # one query
    (1, 64, 100, 1, 64),   # block-aligned Lq, mlen < Lq
]


@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "B{}-Lq{}-Lk{}-H{}-D{}".format(*s))
def test_causal_fp32(shape):
    B, Lq, Lk, H, D = shape
    _check(_inputs(B, Lq, Lk, H, D), D ** -0.5, -1, 0)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_dtypes_layouts(dtype, layout):
    # mlen > 0, head dim 41 (padded), seq-first strided views
    _check(_inputs(2, 19, 33, 2, 41, dtype=dtype, layout=layout, seed=1), 41 ** -0.5, -1, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_long_memory(dtype):
    _check(_inputs(1, 21, 70, 2, 64, dtype=dtype, seed=2), 0.125, -1, 0)


def test_scale_and_large_inputs():
    # a non-default softmax scale and inputs large enough for a peaked softmax
    ts = make_inputs(1, 29, 45, 2, 16, device=FUSED_DEVICE, seed=3, requires_grad=True,
                     scale=2.0)
    _check(ts, 0.3, -1, 0)


def test_head_dim_256():
    _check(_inputs(1, 5, 9, 1, 256, seed=4), 256 ** -0.5, -1, 0)


# --------------------------------------------------------------------------------------------
# Windows, non-causal, Conformer layout
# --------------------------------------------------------------------------------------------

WINDOWS = [
    # (Lq, Lk, R, window_left, window_right)
    (20, 90, 90, 30, 0),     # same_length-like: most key tiles and diagonals skipped
    (37, 50, 86, 10, 5),     # non-causal band
    (33, 33, 65, 0, 0),      # diagonal only
    (25, 40, 64, -1, 3),     # non-causal, bounded look-ahead
]


@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "Lq{}-Lk{}-R{}-w{}_{}".format(*c))
def test_window(case):
    Lq, Lk, R, wl, wr = case
    _check(_inputs(2, Lq, Lk, 2, 16, R=R, seed=5), 0.25, wl, wr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_conformer_noncausal(dtype):
    # Lk = Lq, R = 2 Lq - 1, full attention
    T = 37
    _check(_inputs(2, T, T, 2, 41, R=2 * T - 1, dtype=dtype, layout="sbhd", seed=6),
           41 ** -0.5, -1, -1)


# --------------------------------------------------------------------------------------------
# Masks and fully masked rows
# --------------------------------------------------------------------------------------------


def test_key_padding():
    B, Lq, Lk, H, D = 3, 37, 50, 2, 16
    g = torch.Generator().manual_seed(7)
    kpm = torch.rand(B, Lk, generator=g) < 0.3
    kpm[1, 13:] = True  # batch 1: only the 13 memory keys remain
    kpm[2, :] = False
    _check(_inputs(B, Lq, Lk, H, D, seed=7), 0.25, -1, 0, kpm=kpm.to(FUSED_DEVICE))


def test_key_padding_strided_and_noncausal():
    B, Lq, Lk, H, D = 2, 23, 31, 2, 16
    g = torch.Generator().manual_seed(8)
    kpm = (torch.rand(Lk, B, generator=g) < 0.4).to(FUSED_DEVICE).t()  # non-contiguous view
    _check(_inputs(B, Lq, Lk, H, D, R=Lq + Lk - 1, seed=8), 0.25, -1, -1, kpm=kpm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dense_attn_mask(dtype):
    B, Lq, Lk, H, D = 2, 37, 45, 2, 41
    g = torch.Generator().manual_seed(9)
    mask = (torch.rand(B, H, Lq, Lk, generator=g) < 0.35).to(FUSED_DEVICE)
    _check(_inputs(B, Lq, Lk, H, D, dtype=dtype, seed=9), 41 ** -0.5, -1, 0, mask=mask)


def test_broadcast_attn_mask_with_window_and_padding():
    B, Lq, Lk, H, D = 2, 30, 47, 2, 16
    g = torch.Generator().manual_seed(10)
    base = (torch.rand(Lq, Lk, generator=g) < 0.3).to(FUSED_DEVICE)
    mask = base.expand(B, H, Lq, Lk)  # zero strides on B and H
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
    kpm[0, :5] = True
    _check(_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, seed=10), 0.25, 12, 4, kpm=kpm, mask=mask)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
def test_fully_masked_rows_have_zero_gradients(dtype):
    B, Lq, Lk, H, D = 2, 21, 30, 2, 16
    mask = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    mask[0, 1, 3] = True          # one row of one head
    mask[1, :, 10:14] = True      # rows 10..13 of every head in batch 1
    mask = mask.to(FUSED_DEVICE)
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
    kpm[1, :9] = True             # with causal and mlen 9: query 0 of batch 1 sees only key 9
    kpm[1, 9] = True              # ... which is padded too: row 0 of batch 1 fully masked
    ts = _inputs(B, Lq, Lk, H, D, dtype=dtype, seed=11)
    dq = _check(ts, 0.25, -1, 0, kpm=kpm, mask=mask)[0]
    assert (dq[0, 3, 1] == 0).all()
    assert (dq[1, 10:14] == 0).all()
    assert (dq[1, 0] == 0).all()
    assert dq[0, 3, 0].abs().sum() > 0  # the other head of that row is not masked


def test_everything_masked_gives_zero_gradients():
    B, Lq, Lk, H, D = 1, 17, 25, 2, 16
    ts = _inputs(B, Lq, Lk, H, D, seed=12)
    kpm = torch.ones(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
    fused = _check(ts, 0.25, -1, 0, kpm=kpm)
    for name, g in zip(NAMES, fused):
        assert (g == 0).all(), f"{name} is not zero with every key masked"


# --------------------------------------------------------------------------------------------
# Memory safety: rows of r outside [0, R), keys beyond Lk, padded head dims are never read
# --------------------------------------------------------------------------------------------


def test_no_reads_outside_tensors():
    """Inputs are views into NaN-filled storage: any read outside a tensor (r rows outside
    [0, R), keys >= Lk, queries >= Lq, columns >= D) would turn a gradient into NaN."""
    B, Lq, Lk, H, D = 2, 19, 35, 2, 24
    R = Lk
    pad = 40
    g = torch.Generator().manual_seed(13)

    def nan_view(L, seq_first):
        shape = (L + 2 * pad, B, H, D + 8) if seq_first else (B, L + 2 * pad, H, D + 8)
        store = torch.full(shape, float("nan"))
        if seq_first:
            store[pad:pad + L, :, :, :D] = torch.randn(L, B, H, D, generator=g)
            return store.to(FUSED_DEVICE)[pad:pad + L, :, :, :D].transpose(0, 1)
        store[:, pad:pad + L, :, :D] = torch.randn(B, L, H, D, generator=g)
        return store.to(FUSED_DEVICE)[:, pad:pad + L, :, :D]

    q, k, v = nan_view(Lq, True), nan_view(Lk, False), nan_view(Lk, True)
    r_store = torch.full((R + 2 * pad, H, D + 8), float("nan"))
    r_store[pad:pad + R, :, :D] = torch.randn(R, H, D, generator=g)
    r = r_store.to(FUSED_DEVICE)[pad:pad + R, :, :D]
    bias_store = torch.full((H, D + 8), float("nan"))
    bias_store[:, :D] = torch.randn(H, D, generator=g)
    u = bias_store.to(FUSED_DEVICE)[:, :D]
    vb = (bias_store.to(FUSED_DEVICE)[:, :D] * 0.5)
    do = nan_view(Lq, False)
    ts = [t.detach().requires_grad_(True) for t in (q, k, v, r, u, vb)]
    for t in (q, k, v, r):
        assert t.stride(-1) == 1 and not t.is_contiguous()
    _check(ts, D ** -0.5, -1, 0, do=do)


@pytest.mark.parametrize("wl,wr,R", [(-1, 0, None), (9, 3, 70)])
def test_descriptor_and_pointer_loads_agree(wl, wr, R):
    """The backward's tiles (q + u, q + vb, dO, K, V, r) load through TMA descriptors when
    every base and row stride is 16-byte aligned, through pointers otherwise: the same inputs
    at an address one element off take the pointer path and give the same gradients, bit for
    bit (r rows outside [0, R) included: R 70 < the distances the window reaches)."""
    from txl_kernels.ops._common import descriptors_ok

    B, Lq, Lk, H, D = 2, 21, 37, 2, 16
    q, k, v, r, u, vb = (t.detach() for t in _inputs(B, Lq, Lk, H, D, R=R, seed=21))
    do = _rand_like_out(B, Lq, H, D, torch.float32)

    def shifted(t):  # the same values at an address 1 element past a 16-byte boundary
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    k2, v2, r2, do2 = shifted(k), shifted(v), shifted(r), shifted(do)
    assert descriptors_ok(do, k, v, r) and not descriptors_ok(do2, k2, v2, r2)
    out, lse = _forward_outputs((q, k, v, r, u, vb), 0.25, wl, wr)
    desc = rel_attn_bwd(do, q, k, v, r, u, vb, out, lse, 0.25, wl, wr)
    ptrs = rel_attn_bwd(do2, q, k2, v2, r2, u, vb, out, lse, 0.25, wl, wr)
    for name, a, b in zip(NAMES, desc, ptrs):
        assert torch.equal(a, b), f"{name}: descriptor and pointer loads differ"


def test_do_with_non_unit_last_stride():
    B, Lq, Lk, H, D = 1, 13, 20, 2, 16
    ts = _inputs(B, Lq, Lk, H, D, seed=14)
    do = _rand_like_out(B, Lq, H, 2 * D, torch.float32)[..., ::2]
    assert do.stride(-1) == 2
    _check(ts, 0.25, -1, 0, do=do)


# --------------------------------------------------------------------------------------------
# Determinism, the atomic mode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_deterministic_bitwise(dtype):
    B, Lq, Lk, H, D = 2, 37, 60, 2, 41
    q, k, v, r, u, vb = (t.detach() for t in _inputs(B, Lq, Lk, H, D, dtype=dtype, seed=15))
    g = torch.Generator().manual_seed(15)
    mask = (torch.rand(B, H, Lq, Lk, generator=g) < 0.2).to(FUSED_DEVICE)
    out, lse = _forward_outputs((q, k, v, r, u, vb), 0.2, 40, 0, None, mask)
    do = _rand_like_out(B, Lq, H, D, dtype)
    first = rel_attn_bwd(do, q, k, v, r, u, vb, out, lse, 0.2, 40, 0, None, mask)
    second = rel_attn_bwd(do, q, k, v, r, u, vb, out, lse, 0.2, 40, 0, None, mask)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical backward calls"


@pytest.mark.parametrize("du_dot", [False, True], ids=["du-tile-sum", "du-product"])
def test_du_column_sum_forms_match(monkeypatch, du_dot):
    """Both forms of the dk/dv kernel's du column sums (DU_DOT: a narrow product on sm_90, a
    summed fp32 dS tile on the other families), with a padding mask so that masked pairs
    and an uneven Lk enter the sums."""
    import txl_kernels.ops.rel_attn_bwd as rb
    monkeypatch.setattr(rb, "_DU_DOT_FAMILIES", ("sm90",) if du_dot else ())
    ts = _inputs(2, 21, 37, 2, 16, R=57, seed=23)
    kpm = torch.zeros(2, 37, dtype=torch.bool, device=FUSED_DEVICE)
    kpm[1, 30:] = True
    _check(ts, 0.25, -1, -1, kpm=kpm)


@pytest.mark.parametrize("fused,det,q_only", [
    (True, False, True), (True, False, False), (True, True, True), (True, True, False),
    (False, False, False),
], ids=["dkdv-atomic-dq-dr", "dkdv-atomic-dq-dr-operands", "dkdv-ordered-dq-dr",
        "dkdv-ordered-dq-dr-operands", "dq-kernel-atomic-dr"])
@pytest.mark.parametrize("case", [
    dict(L=(37, 50), R=86, win=(20, 3)),       # window, r shorter than the pair distances
    dict(L=(1, 1), R=1, win=(-1, 0)),          # one query, one key
    dict(L=(37, 37), R=37, win=(-1, -1)),      # non-causal, r rows 0 .. 36 only
    dict(L=(21, 53), R=120, win=(-1, 0), kpm=True),
    dict(L=(20, 70), R=100, win=(5, 0)),       # key tiles no query sees: programs with no tile
], ids=["window", "len1", "noncausal-shortR", "memory-kpm", "memory-past-window"])
def test_atomic_modes_match(monkeypatch, fused, det, case, q_only):
    """The atomic paths (_fused_dq): the dk/dv kernel with dq and dr by atomics (ATOMIC: fp16
    / bf16 on the _FUSED_DQ_FAMILIES), in any order (deterministic=False) or in key-tile
    order (ORDERED, deterministic=True), from q tiles with the bias terms apart (Q_ONLY: sm_90
    up to D 64) or from the preprocessed operands, and the dq kernel with the atomic dr (fp32,
    and the other families), all forced here in fp32 (the tightest check); the fp16 / bf16
    tests take ATOMIC and Q_ONLY on their own (the interpreter runs sm_90's family)."""
    import txl_kernels.ops.rel_attn_bwd as rb
    monkeypatch.setattr(rb, "_fused_dq", lambda family, wide: fused)
    monkeypatch.setattr(rb, "_q_only", lambda family, block_d: q_only)
    (lq, lk), (wl, wr) = case["L"], case["win"]
    ts = _inputs(2, lq, lk, 2, 16, R=case["R"], seed=16)
    kpm = None
    if case.get("kpm"):
        kpm = torch.zeros(2, lk, dtype=torch.bool, device=FUSED_DEVICE)
        kpm[1, lk - 9:] = True
    _check(ts, 0.25, wl, wr, kpm=kpm, deterministic=det)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _args():
    q, k, v, r, u, vb = (t.detach() for t in _inputs(1, 5, 8, 2, 16, seed=17))
    out, lse = _forward_outputs((q, k, v, r, u, vb), 0.25, -1, 0)
    return [torch.randn_like(out), q, k, v, r, u, vb, out, lse, 0.25, -1, 0, None, None]


BAD = [
    ("do shape", 0, lambda a: a[0][:, :4], "do must be [1, 5, 2, 16]"),
    ("lse dtype", 8, lambda a: a[8].double(), "lse must be [1, 2, 5] torch.float32"),
    ("lse shape", 8, lambda a: a[8][:, :1], "lse must be [1, 2, 5]"),
    ("v dtype", 3, lambda a: a[3].half(), "v must be [1, 8, 2, 16] torch.float32"),
    ("k heads", 2, lambda a: a[2][:, :, :1], "rel_attn_bwd: "),
    ("r dim", 4, lambda a: a[4][..., :8], "r must be ["),
    ("u shape", 5, lambda a: a[5][:1], "r_w_bias must be [2, 16]"),
    ("q dtype", 1, lambda a: a[1].double(), "rel_attn_bwd: q "),
    ("kpm shape", 12, lambda a: torch.zeros(1, 7, dtype=torch.bool, device=FUSED_DEVICE),
     "key_padding_mask must be [1, 8]"),
    ("mask shape", 13, lambda a: torch.zeros(1, 1, 5, 8, dtype=torch.bool, device=FUSED_DEVICE),
     "attn_mask must be [1, 2, 5, 8]"),
]


@pytest.mark.parametrize("desc,pos,make,text", BAD, ids=[b[0] for b in BAD])
def test_launcher_asserts_its_invariants(desc, pos, make, text):
    """The launcher only asserts (rel_attention validates and names the bad argument)."""
    args = _args()
    args[pos] = make(args)
    with pytest.raises(AssertionError, match=pytest.importorskip("re").escape(text)):
        rel_attn_bwd(*args)


def test_small_head_dim_asserted():
    args = _args()
    args[1:8] = [t[..., :8] for t in args[1:8]]
    args[0] = args[0][..., :8]
    with pytest.raises(AssertionError, match="rel_attn_bwd: q"):
        rel_attn_bwd(*args)


# --------------------------------------------------------------------------------------------
# End to end: rel_attention(..., backend="triton") + backward (fused forward and backward)
# --------------------------------------------------------------------------------------------

E2E = [
    # (dtype, layout, Lq, Lk, R, causal, window, kpm, dense mask)
    (torch.float32, "sbhd", 37, 60, 60, True, (-1, -1), False, False),
    (torch.float16, "bshd", 29, 45, 73, False, (15, 6), True, False),
    (torch.bfloat16, "sbhd", 21, 21, 41, False, (-1, -1), False, True),
]


@pytest.mark.parametrize("case", E2E, ids=lambda c: f"{c[0]}-{c[1]}-Lq{c[2]}-Lk{c[3]}")
def test_end_to_end_triton_backend(case):
    dtype, layout, Lq, Lk, R, causal, window, use_kpm, use_mask = case
    B, H, D = 2, 2, 41
    ts = make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, device=FUSED_DEVICE, layout=layout,
                     seed=20, requires_grad=True)
    g = torch.Generator().manual_seed(20)
    kpm = (torch.rand(B, Lk, generator=g) < 0.2).to(FUSED_DEVICE) if use_kpm else None
    mask = (torch.rand(B, 1, Lq, Lk, generator=g) < 0.3).to(FUSED_DEVICE) if use_mask else None
    kw = dict(causal=causal, window_size=window, key_padding_mask=kpm, attn_mask=mask)
    do = _rand_like_out(B, Lq, H, D, dtype, seed=21)

    out = txl_kernels.rel_attention(*ts, backend="triton", **kw)
    fused = torch.autograd.grad(out, ts, do)
    out_ref = txl_kernels.rel_attention(*ts, backend="reference", **kw)
    same = torch.autograd.grad(out_ref, ts, do)
    up = [t.detach().double().requires_grad_(True) for t in ts]
    truth = torch.autograd.grad(txl_kernels.rel_attention(*up, backend="reference", **kw), up,
                                do.double())
    assert_within("out", out, out_ref, txl_kernels.rel_attention(*up, backend="reference", **kw))
    for name, got, sp, tr, inp in zip(NAMES, fused, same, truth, ts):
        assert got.shape == inp.shape and got.dtype == inp.dtype, name
        assert_within(name, got, sp, tr)

    # the default deterministic=False adds dq / dr with atomics (bitwise repeatable only under
    # the interpreter); the deterministic mode is as accurate (bitwise repeats:
    # test_deterministic_bitwise)
    det = torch.autograd.grad(
        txl_kernels.rel_attention(*ts, backend="triton", deterministic=True, **kw), ts, do)
    for name, got, sp, tr in zip(NAMES, det, same, truth):
        assert_within(name + " (deterministic)", got, sp, tr)


# --------------------------------------------------------------------------------------------
# GPU only: larger shapes, the autotuned configs, TF32
# --------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_cuda_larger_shapes(dtype, D):
    ts = make_inputs(2, 200, 700, 4, D, dtype=dtype, device="cuda", layout="sbhd", seed=30,
                     requires_grad=True)
    _check(ts, D ** -0.5, 500, 0)


@requires_cuda
def test_cuda_tf32_follows_matmul_precision():
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        ts = make_inputs(2, 130, 300, 2, 64, device="cuda", seed=31, requires_grad=True)
        _check(ts, 0.125, -1, 0)
    finally:
        torch.set_float32_matmul_precision(prev)


def test_autotune_pruning_keeps_configs_that_fit():
    """The GPU config list is pruned to tiles that fit on sm_90 (shared memory sizes from
    ahead-of-time compiles); checked here on the pruning function itself."""
    import triton

    from txl_kernels.ops.rel_attn_bwd import _make_prune

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (4, 8)]

    def blocks(extra, dtype, block_d, L=4096):
        q = torch.empty(1, 1, 1, 1, dtype=dtype)
        kept = _make_prune(extra)(configs, {"K": q, "Lq": L, "Lk": L}, BLOCK_D=block_d)
        return sorted({c.kwargs["BLOCK"] for c in kept})

    assert blocks(False, torch.float16, 64) == [32, 64]
    assert blocks(True, torch.bfloat16, 256) == [32]
    assert blocks(False, torch.float32, 128) == [32]
    assert blocks(False, torch.float32, 256) == [32]
    assert blocks(True, torch.float32, 256) == [16]
    assert blocks(False, torch.float16, 64, L=20) == [32]


def test_default_config_is_a_kept_autotune_config(monkeypatch):
    """The TXL_KERNELS_AUTOTUNE=0 config of each backward kernel is one the autotuner would
    also try: in the GPU config list and kept by the pruning, for every dtype / head dim."""
    import txl_kernels.ops.rel_attn_bwd as rb

    monkeypatch.setattr(rb, "INTERPRET", False)
    gpu = {(c.kwargs["BLOCK"], c.num_warps, c.num_stages): c for c in rb._configs()}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for exact in ((False, True) if dtype == torch.float32 else (False,)):
            for block_d in (16, 64, 128, 256):
                for extra in (False, True):
                    for L in (20, 4096):
                        cfg = rb._default_config(block_d, exact, dtype == torch.float32,
                                                 extra_tiles=extra, lq=L, lk=L)
                        key = (cfg["BLOCK"], cfg["num_warps"], cfg["num_stages"])
                        assert key in gpu, (dtype, block_d, extra, L, cfg)
                        kept = rb._make_prune(extra)(list(gpu.values()),
                                                     {"K": torch.empty(1, dtype=dtype),
                                                      "Lq": L, "Lk": L}, BLOCK_D=block_d)
                        assert gpu[key] in kept, (dtype, block_d, extra, L, cfg)
    assert rb._default_config(64, False) == {"BLOCK": 64, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("autotune", ["0", "1"])
def test_autotune_switch_is_honoured(monkeypatch, autotune):
    """On GPU, TXL_KERNELS_AUTOTUNE=0 launches each backward kernel once with its default
    config (as the forward does); otherwise through its autotuner. Launches are recorded on
    meta tensors (no kernel runs)."""
    import txl_kernels.ops.rel_attn_bwd as rb

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, kw))

    for name in ("_rel_attn_bwd_preprocess_kernel", "_rel_attn_bwd_dkdv_kernel",
                 "_rel_attn_bwd_dq_kernel", "_rel_attn_bwd_dr_kernel", "_dkdv_kernel",
                 "_dq_kernel", "_dr_kernel"):
        monkeypatch.setattr(rb, name, Recorder(name))
    monkeypatch.setattr(rb, "INTERPRET", False)
    monkeypatch.setenv("TXL_KERNELS_AUTOTUNE", autotune)
    B, L, H, D = 1, 4096, 2, 64

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    # bf16: the dk/dv kernel with dq and dr (ORDERED: deterministic); fp32: the three kernels
    for dtype, kernels, cfg in ((torch.bfloat16, ("dkdv",), (64, 4, 2)),
                                (torch.float32, ("dkdv", "dq", "dr"), (32, 4, 2))):
        launched.clear()
        rb.rel_attn_bwd(*(t(*s, dtype=dtype) for s in ((B, L, H, D),) * 4
                          + ((L, H, D), (H, D), (H, D), (B, L, H, D))),
                        t(B, H, L, dtype=torch.float32), D ** -0.5, -1, 0)
        names = [n for n, _ in launched]
        if autotune == "0":
            assert names == ["_rel_attn_bwd_preprocess_kernel"] + [
                f"_rel_attn_bwd_{k}_kernel" for k in kernels]
            for _, kw in launched[1:]:
                assert (kw["BLOCK"], kw["num_warps"], kw["num_stages"]) == cfg
        else:
            assert names == ["_rel_attn_bwd_preprocess_kernel"] + [f"_{k}_kernel"
                                                                   for k in kernels]
            assert all("BLOCK" not in kw for _, kw in launched[1:])
        assert launched[1][1]["ORDERED"] is (dtype == torch.bfloat16)


def test_autotuned_atomic_runs_start_from_zero():
    """The dk/dv autotuner zeroes the ATOMIC dq / dr buffers and the ORDERED progress slots
    (inside its ``atomics`` tuple, out of reach of reset_to_zero) before each trial and before
    the chosen config's run: a trial left with published progress would let the next run's
    programs add out of order."""
    import txl_kernels.ops.rel_attn_bwd as rb
    assert rb._dkdv_kernel.pre_hook is rb._zero_atomics
    dq, dr, sems = torch.ones(2, 3), torch.ones(4), torch.ones(5, dtype=torch.int32)
    for reset_only in (False, True):
        for buf in (dq, dr, sems):
            buf.fill_(1)
        rb._zero_atomics({"ATOMIC": True, "ORDERED": True,
                          "atomics": (dq, (3, 1, 1), dr, (0, 1, 1), sems, 5)}, reset_only)
        assert not dq.any() and not dr.any() and not sems.any()
    rb._zero_atomics({"ATOMIC": False, "atomics": 0})  # no buffers without ATOMIC


def test_atomics_only_where_their_int32_offsets_fit(monkeypatch):
    """The atomics index their dr [R, H, D] (and dq [B, Lq, H, D]) buffers with int32 offsets:
    where they could overflow, the deterministic kernels run instead, on every atomic path
    (the ORDERED one too: launches recorded on meta tensors; nothing runs)."""
    import txl_kernels.ops.rel_attn_bwd as rb

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(
                (self.name[len("_rel_attn_bwd_"):-len("_kernel")],
                 kw.get("ATOMIC", kw.get("ATOMIC_DR")), kw.get("ORDERED")))

    for name in ("_rel_attn_bwd_preprocess_kernel", "_rel_attn_bwd_dkdv_kernel",
                 "_rel_attn_bwd_dq_kernel", "_rel_attn_bwd_dr_kernel"):
        monkeypatch.setattr(rb, name, Recorder(name))
    monkeypatch.setattr(rb, "INTERPRET", False)
    monkeypatch.setenv("TXL_KERNELS_AUTOTUNE", "0")
    B, L, H, D = 1, 64, 16, 64
    deterministic = [("preprocess", None, None), ("dkdv", False, False), ("dq", False, None),
                     ("dr", None, None)]

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    for fused, det in ((True, False), (True, True), (False, False)):
        monkeypatch.setattr(rb, "_fused_dq", lambda family, wide, fused=fused: fused)
        atomic_launches = ([("preprocess", None, None), ("dkdv", True, det)] if fused else
                           [("preprocess", None, None), ("dkdv", False, False),
                            ("dq", True, None)])
        for R, atomic in ((L, True), (2 ** 31 // (H * D) - 200, False), (2 ** 21, False)):
            assert rb._atomic_offsets_fit(R, L, L, H, D) is atomic
            launched.clear()
            rb.rel_attn_bwd(t(B, L, H, D), t(B, L, H, D), t(B, L, H, D), t(B, L, H, D),
                            t(R, H, D), t(H, D), t(H, D), t(B, L, H, D),
                            t(B, H, L, dtype=torch.float32), D ** -0.5, -1, 0,
                            deterministic=det)
            assert launched == (atomic_launches if atomic else deterministic), (R, launched)
    assert rb._atomic_offsets_fit(2 ** 31 // (H * D) - 300, L, L, H, D)


def test_public_deterministic_flag():
    """rel_attention(deterministic=False) reaches the atomic dR path; gradients still match."""
    grads = {}
    for det in (True, False):
        ts = [t.detach().requires_grad_(True)
              for t in _inputs(2, 21, 40, 2, 16, R=60, seed=23)]
        out = txl_kernels.rel_attention(*ts, causal=False, window_size=(25, 4),
                                        backend="triton", deterministic=det)
        out.backward(torch.ones_like(out))
        grads[det] = [t.grad for t in ts]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        txl_kernels.rel_attention(*grads[True], backend="triton", deterministic=1)
