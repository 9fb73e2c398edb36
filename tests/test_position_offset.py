"""``rel_attention(r_first_distance=)``: a position table whose row 0 holds distance
``r_first_distance`` (row p: distance ``r_first_distance - p``), e.g. the ``left + right + 1``
rows of a window. Every backend is checked against the reference with the equivalent full
table (the short table embedded at its distances' rows of a zero ``Lk + Lq - 1``-row table,
``r_first_distance=None``): forward and all six gradients."""
from __future__ import annotations

import pytest
import torch

from txl_kernels import rel_attention
from txl_kernels.quant import quantize_kv
from txl_kernels.reference import rel_attention_reference

from helpers import make_inputs

BACKENDS = ["reference", "cpu", "triton"]
# (backend, dtype): fp64 where the backend has it, fp16 on the Triton kernels (bf16 tl.dot is
# wrong in the interpreter)
BACKEND_DTYPES = [(b, d) for b in ("reference", "cpu") for d in (torch.float32, torch.float64)]
BACKEND_DTYPES += [("triton", torch.float32), ("triton", torch.float16)]


def _dtype(backend):
    """The dtype of the single-dtype cases: fp64 where the backend has it."""
    return torch.float32 if backend == "triton" else torch.float64


def full_table(r_short, first, lq, lk):
    """The default table (row P holds distance ``Lk - 1 - P``, ``Lk + Lq - 1`` rows) with
    ``r_short``'s row p (distance ``first - p``) at row ``P = Lk - 1 - first + p``, zero
    elsewhere; also the (p, P) pairs of the short rows that land in it."""
    R = r_short.shape[0]
    full = r_short.new_zeros((lk + lq - 1,) + tuple(r_short.shape[1:]))
    p = torch.arange(R)
    P = lk - 1 - first + p
    inside = (P >= 0) & (P < lk + lq - 1)
    full[P[inside]] = r_short[p[inside]]
    return full, p[inside], P[inside]


def check_against_full(backend, B, Lq, Lk, H, D, R, first, dtype, window, causal=False,
                       kpm=None, grad=True, tol=None, scale=1.0, deterministic=False):
    ts = make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, seed=Lq * 7 + Lk + R, scale=scale)
    q, k, v, r, u, vb = (t.requires_grad_(grad) for t in ts)
    out = rel_attention(q, k, v, r, u, vb, causal=causal, window_size=window,
                        key_padding_mask=kpm, backend=backend, r_first_distance=first,
                        deterministic=deterministic)
    # the oracle: the reference with the full table, in float64 for low-precision inputs
    acc = torch.float64 if dtype in (torch.float16, torch.bfloat16) else dtype
    full, p_in, P_in = full_table(r.detach(), first, Lq, Lk)
    ref_in = [t.detach().to(acc).requires_grad_(grad) for t in (q, k, v, full, u, vb)]
    ref = rel_attention(*ref_in, causal=causal, window_size=window, key_padding_mask=kpm,
                        backend="reference")
    if tol is None:
        tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out.to(acc), ref, atol=tol, rtol=tol)
    if not grad:
        return
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, r, u, vb), dout)
    ref_grads = list(torch.autograd.grad(ref, ref_in, dout.to(acc)))
    # dr of the short table: the full table's dr at the short rows' places, 0 for short
    # rows that lie outside it (no pair reads them)
    dr_full = ref_grads[3]
    ref_grads[3] = dr_full.new_zeros((R,) + tuple(dr_full.shape[1:]))
    ref_grads[3][p_in] = dr_full[P_in]
    for name, got, want in zip(("dq", "dk", "dv", "dr", "dr_w_bias", "dr_r_bias"), grads,
                               ref_grads):
        mag = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.to(acc), want, atol=tol * mag, rtol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def window_table(window):
    left, right = window
    return left + right + 1, left


# (Lq, Lk, window): the short table of a window (left + right + 1 rows, first = left)
WINDOW_CASES = [
    (37, 37, (3, 5)),
    (37, 37, (5, 0)),
    (37, 37, (4, 4)),
    (1, 1, (2, 3)),
    (3, 3, (6, 6)),         # T < window: every row of the table is past a sequence end
    (7, 19, (4, 2)),        # Lk > Lq (keys in front of the queries)
]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("lq,lk,window", WINDOW_CASES)
def test_window_table_matches_full_table(backend, dtype, lq, lk, window):
    R, first = window_table(window)
    check_against_full(backend, 2, lq, lk, 2, 41, R, first, dtype, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window", [(6, 4), (9, 0)])
def test_cpu_band_tiles_with_window_table(dtype, window):
    """The CPU kernel's band tiles over many query blocks and two forward chunks (700
    queries), heads 3, head dim 41, with the window's own table (fp32: r^T packed once per
    task and multiplied by every block)."""
    R, first = window_table(window)
    check_against_full("cpu", 2, 700, 700, 3, 41, R, first, dtype, window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_table_with_key_padding_and_causal(backend):
    lq = lk = 13
    kpm = torch.zeros(2, lk, dtype=torch.bool)
    kpm[0, 9:] = True
    kpm[1, :2] = True
    R, first = window_table((4, 0))
    check_against_full(backend, 2, lq, lk, 2, 16, R, first, torch.float32, (4, 3),
                       causal=True, kpm=kpm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,first,window", [
    (20, 9, (6, 7)),     # rows on both sides that no allowed pair reads
    (5, 2, (2, 2)),      # exactly the window
    (6, 0, (0, 5)),      # only keys at or after the query (d <= 0)
    (9, 6, (-1, 2)),     # unbounded left side: enough rows for every d the shapes hold
])
def test_any_first_distance(backend, R, first, window):
    lq = lk = 7 if window[0] < 0 else 11
    check_against_full(backend, 1, lq, lk, 2, 16, R, first, _dtype(backend), window)


@pytest.mark.parametrize("fused,q_only,det", [
    (False, False, False),  # dq kernel with atomic dr (fp32's default)
    (False, False, True),   # dq kernel, then the dr kernel over block diagonals
    (True, False, False),   # dk/dv kernel with dq and dr by atomics
    (True, False, True),    # ... in key-tile order (ORDERED)
    (True, True, False),    # ... from q tiles (Q_ONLY)
    (True, True, True),
])
def test_triton_backward_modes(monkeypatch, fused, q_only, det):
    """Every Triton backward path (forced, in fp32) with a window table: the r rows of each
    tile come from the row constant, dr lands on the short table's rows."""
    import txl_kernels.ops.rel_attn_bwd as rb
    monkeypatch.setattr(rb, "_fused_dq", lambda family, wide: fused)
    monkeypatch.setattr(rb, "_q_only", lambda family, block_d: q_only)
    R, first = window_table((3, 5))
    check_against_full("triton", 2, 21, 21, 2, 16, R, first, torch.float32, (3, 5),
                       deterministic=det)
    R, first = window_table((4, 2))  # Lk > Lq
    check_against_full("triton", 1, 7, 30, 2, 16, R, first, torch.float32, (4, 2),
                       deterministic=det)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_split_k_forward(num_splits):
    """The split-K forward (each split primes its window from the row constant)."""
    from txl_kernels.ops.rel_attn_fwd import rel_attn_fwd

    lq = lk = 50
    window = (20, 6)
    R, first = window_table(window)
    q, k, v, r, u, vb = make_inputs(1, lq, lk, 2, 16, R=R, seed=5)
    out, lse = rel_attn_fwd(q, k, v, r, u, vb, 0.25, *window, num_splits=num_splits,
                            r_first_distance=first)
    full, _, _ = full_table(r, first, lq, lk)
    ref, ref_lse = rel_attention_reference(q, k, v, full, u, vb, 0.25, *window,
                                           return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_first_distance_is_bit_identical(backend):
    """r_first_distance = Lk - 1 is the default table: the same bits as None."""
    lq, lk = 9, 14
    q, k, v, r, u, vb = make_inputs(2, lq, lk, 2, 16, R=lk + lq - 1)
    a = rel_attention(q, k, v, r, u, vb, causal=False, backend=backend)
    b = rel_attention(q, k, v, r, u, vb, causal=False, backend=backend,
                      r_first_distance=lk - 1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_outside_the_table_read_as_zero_under_a_band(backend):
    """With attn_mask_band the rows are not checked on the host; pairs reading rows outside
    [0, R) get a zero position term, as with a zero full table."""
    from txl_kernels import mask_to_band

    lq = lk = 10
    q, k, v, r, u, vb = make_inputs(1, lq, lk, 2, 16, R=3, dtype=_dtype(backend))
    mask = torch.ones(lq, lk, dtype=torch.bool).triu(1)  # causal, densely: d >= 0
    band = mask_to_band(mask)
    out = rel_attention(q, k, v, r, u, vb, causal=False, attn_mask=mask, attn_mask_band=band,
                        backend=backend, r_first_distance=1)
    full, _, _ = full_table(r, 1, lq, lk)
    ref = rel_attention(q, k, v, full, u, vb, causal=False, attn_mask=mask, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("first", [10 ** 6, -10 ** 6])
def test_far_first_distance_reads_only_zero_rows(backend, first):
    """A first distance far past the table: every row read is outside [0, R), the position
    term is 0 (a band lets the call through the host check)."""
    from txl_kernels import mask_to_band

    lq = lk = 6
    q, k, v, r, u, vb = make_inputs(1, lq, lk, 2, 16, R=3, dtype=_dtype(backend))
    mask = torch.zeros(lq, lk, dtype=torch.bool)
    out = rel_attention(q, k, v, r, u, vb, causal=False, attn_mask=mask,
                        attn_mask_band=mask_to_band(mask), backend=backend,
                        r_first_distance=first)
    ref = rel_attention(q, k, v, r.new_zeros(lk + lq - 1, 2, 16), u, vb, causal=False,
                        backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_bad_type_raises_naming_the_argument():
    q, k, v, r, u, vb = make_inputs(1, 4, 4, 1, 16, R=7)
    for bad in (1.0, True, "3", torch.tensor(3)):
        with pytest.raises(TypeError, match="r_first_distance must be an int"):
            rel_attention(q, k, v, r, u, vb, causal=False, r_first_distance=bad)


@pytest.mark.parametrize("window,R,first", [
    ((3, 3), 6, 3),    # one row short at the end (distance -3)
    ((3, 3), 7, 2),    # the table starts one distance too low
    ((-1, -1), 7, 3),  # a full attention needs distances 3 .. -3 here: (4, 4) at T = 5
])
def test_missing_rows_raise_naming_r_and_the_rows(window, R, first):
    lq = lk = 5
    q, k, v, r, u, vb = make_inputs(1, lq, lk, 1, 16, R=R)
    with pytest.raises(ValueError, match=r"r has \d+ rows and r_first_distance=.*need rows "
                                         r"-?\d+\.\.\d+"):
        rel_attention(q, k, v, r, u, vb, causal=False, window_size=window,
                      r_first_distance=first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_table_with_8bit_memory(backend):
    """With an 8-bit memory (M rows in front of the segment's keys, Lk = M + Lc): the
    same as the reference over the dequantised keys with the full table (forward only)."""
    B, M, Lc, H, D = 2, 9, 12, 2, 16
    window = (5, 3)
    R, first = window_table(window)
    q, k, v, r, u, vb = make_inputs(B, Lc, Lc, H, D, R=R, seed=3)
    _, mk, mv, _, _, _ = make_inputs(B, M, M, H, D, seed=4)
    memory = quantize_kv(mk, mv, torch.int8)
    with torch.no_grad():
        out = rel_attention(q, k, v, r, u, vb, causal=False, window_size=window,
                            memory=memory, backend=backend, r_first_distance=first)
        dk, dv = memory.dequantize(q.dtype)
        kf, vf = torch.cat([dk, k], 1).double(), torch.cat([dv, v], 1).double()
        full, _, _ = full_table(r, first, Lc, M + Lc)
        ref = rel_attention(q.double(), kf, vf, full.double(), u.double(), vb.double(),
                            causal=False, window_size=window, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def _op_case(device="cpu"):
    """A windowed call's operands with the window's table (the ops' positional arguments up to
    the masks; window (3, 2), r of 6 rows, row 0 at distance 3)."""
    B, L, H, D = 1, 9, 2, 16
    q, k, v, r, u, vb = make_inputs(B, L, L, H, D, R=6, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, 1] = True
    return (q, k, v, r, u, vb, D ** -0.5, 3, 2, kpm, None, None, 0.0, None)


def test_opcheck_ops_with_r_first_distance(extension):
    """The ops' schemas, fake implementations and autograd with the trailing
    r_first_distance (forward op; its autograd runs the backward op with it), on the CPU
    kernel."""
    args = _op_case() + (None, None, None, None, 3)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default, args)
    q, k, v, r, u, vb = (t.detach() for t in args[:6])
    out, lse = torch.ops.txl_kernels.rel_attn_fwd(*args)
    bargs = ((torch.randn_like(out), q, k, v, r, u, vb, out.detach(), lse) + args[6:12]
             + (True,) + args[12:14] + (3,))
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_bwd.default, bargs)


class _WindowAttn(torch.nn.Module):
    def __init__(self, backend, H=2, D=8):
        super().__init__()
        self.backend = backend
        self.u = torch.nn.Parameter(torch.randn(H, D))
        self.vb = torch.nn.Parameter(torch.randn(H, D))

    def forward(self, q, k, v, r, kpm):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=False, window_size=(3, 5),
                             key_padding_mask=kpm, backend=self.backend, r_first_distance=3)


def _export_inputs(T, B=2, H=2, D=8):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    r = torch.randn(9, H, D, generator=g)  # the window's table: a static size
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -2:] = True
    return q, k, v, r, kpm


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_export_dynamic_length_with_window_table(backend):
    """The row offset adds no guard on T: one exported program for every length (from 6 on:
    below the window's sides the window's own clamping specialises, with or without the
    argument)."""
    m = _WindowAttn(backend).eval()
    T = torch.export.Dim("T", min=6, max=4096)
    ep = torch.export.export(m, _export_inputs(8),
                             dynamic_shapes=({1: T}, {1: T}, {1: T}, None, {1: T}))
    for t in (6, 13, 40):
        x = _export_inputs(t)
        torch.testing.assert_close(ep.module()(*x), m(*x), rtol=0, atol=0)


@pytest.mark.parametrize("mem_rows", [0, 6])
@pytest.mark.parametrize("window_left,R,first", [
    (4, 5, 4),     # the window's table: distances 4 .. 0
    (4, 8, 6),     # two rows above it and one below that no key reads
    (-1, 19, 18),  # no window: distances 17 .. 0 (Lk = 18) and one row above
])
def test_decode_kernel_window_table(mem_rows, window_left, R, first):
    """The split-K decode kernel (one query row, the K/V cache's generation step) with a
    table whose row 0 holds distance ``first``: the reference with the full table (and the
    8-bit memory's keys in front)."""
    from txl_kernels.ops.rel_attn_decode import rel_attn_decode

    B, Lc, H, D = 2, 18 - mem_rows, 2, 16
    q, k, v, r, u, vb = make_inputs(B, 1, Lc, H, D, R=R, seed=9)
    memory = None
    kf, vf = k, v
    if mem_rows:
        _, mk, mv, _, _, _ = make_inputs(B, mem_rows, mem_rows, H, D, seed=10)
        memory = quantize_kv(mk, mv, torch.int8)
        dk, dv = memory.dequantize(torch.float32)
        kf, vf = torch.cat([dk, k], 1), torch.cat([dv, v], 1)
    Lk = kf.shape[1]
    got = rel_attn_decode(q, k, v, r, u, vb, 0.25, window_left, num_splits=2, memory=memory,
                          r_first_distance=first)
    full, _, _ = full_table(r, first, 1, Lk)
    want = rel_attention_reference(q.double(), kf.double(), vf.double(), full.double(),
                                   u.double(), vb.double(), 0.25, window_left, 0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_decode_kernel_missing_rows_raise():
    from txl_kernels.ops.rel_attn_decode import rel_attn_decode

    q, k, v, r, u, vb = make_inputs(1, 1, 10, 1, 16, R=4)
    with pytest.raises(ValueError, match=r"r has 4 rows and r_first_distance=4.*need rows "
                                         r"0\.\.4"):
        rel_attn_decode(q, k, v, r, u, vb, 0.25, 4, r_first_distance=4)
    with pytest.raises(TypeError, match="r_first_distance must be an int"):
        rel_attn_decode(q, k, v, r, u, vb, 0.25, 4, r_first_distance=4.0)


def test_context_parallel_ring_raises_not_implemented():
    """The ring indexes the full table in its blocks: r_first_distance raises
    NotImplementedError naming it, before any communication (no process group here)."""
    from txl_kernels.distributed import context_parallel_rel_attention

    q, k, v, r, u, vb = make_inputs(1, 6, 6, 1, 16, R=5)
    with pytest.raises(NotImplementedError, match="r_first_distance is not supported by the "
                                                  "ring"):
        context_parallel_rel_attention(q, k, v, r, u, vb, causal=False, window_size=(2, 2),
                                       backend="reference", r_first_distance=2)
