"""What the masks exclude never reaches a result (issue #42, item 1): NaN / +-inf in the k, v
or r rows (or an 8-bit memory's scales) that only excluded pairs use leave every output and
gradient as they are with those entries set to 0, on every backend; an allowed pair that uses
a non-finite operand still makes its query row non-finite (never a silent finite answer).

Backends: the einsum reference (float64, D 4), the Triton kernels under the interpreter
(float32, D 16: their smallest head dim) and the C++ CPU kernel (float64, D 4)."""
import math

import pytest
import torch

from txl_kernels import QuantizedKV, rel_attention
from txl_kernels.quant import quantize_kv

from helpers import FUSED_DEVICE, make_inputs

NAMES = ("q", "k", "v", "r", "u", "vb")
VALUES = [float("nan"), float("inf"), float("-inf")]
VALUE_IDS = ["nan", "inf", "-inf"]
BACKENDS = ["reference", "triton", "cpu"]
SETUP = {  # dtype, head dim, device
    "reference": (torch.float64, 4, "cpu"),
    "cpu": (torch.float64, 4, "cpu"),
    "triton": (torch.float32, 16, FUSED_DEVICE),
}


def _inputs(backend, Lq, Lk, R=None, seed=0):
    dtype, D, dev = SETUP[backend]
    R = Lq + Lk - 1 if R is None else R  # every distance
    return make_inputs(1, Lq, Lk, 1, D, R=R, dtype=dtype, device=dev, seed=seed)


def _run(backend, ts, grads=True, **kw):
    """(out, [dq, dk, dv, dr, du, dvb]) of rel_attention on fresh leaves of ``ts``, the
    gradients of ``(out * w).sum()`` for a fixed random w."""
    leaves = [t.detach().clone().requires_grad_(grads) for t in ts]
    out = rel_attention(*leaves, backend=backend, **kw)
    if not grads:
        return out.detach(), None
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64).to(out.dtype).to(out.device)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _poison(ts, entries, value):
    """Copies of ``ts`` with ``entries`` ((name, index) pairs) set to ``value``."""
    ts = [t.clone() for t in ts]
    for name, idx in entries:
        ts[NAMES.index(name)][idx] = value
    return ts


def _assert_same(backend, got, want, what):
    if backend == "triton":  # the same kernels on the same values: equal up to reordering
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _check_unaffected(backend, ts, entries, value, grads=True, **kw):
    """Poisoning ``entries`` changes nothing: outputs and gradients finite and equal to the
    run with those entries set to 0; and (triton, cpu) equal to the reference's."""
    out0, g0 = _run(backend, _poison(ts, entries, 0.0), grads, **kw)
    out, g = _run(backend, _poison(ts, entries, value), grads, **kw)
    assert torch.isfinite(out).all(), "output not finite"
    _assert_same(backend, out, out0, "output")
    for name, a, b in zip(NAMES, g or [], g0 or []):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        _assert_same(backend, a, b, f"d{name}")
    if backend != "reference":
        ref_ts = [t.detach().cpu().double() for t in _poison(ts, entries, 0.0)]
        kw_ref = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
        rout, rg = _run("reference", ref_ts, grads, **kw_ref)
        tol = dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.cpu().double(), rout, **tol)
        for name, a, b in zip(NAMES, g or [], rg or []):
            torch.testing.assert_close(a.cpu().double(), b, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["v", "k"])
def test_padded_key(backend, name, value):
    """kpm[0, 2] = True and that key's v (or k) row non-finite, causal=False."""
    ts = _inputs(backend, 5, 7)
    kpm = torch.zeros(1, 7, dtype=torch.bool, device=ts[0].device)
    kpm[0, 2] = True
    _check_unaffected(backend, ts, [(name, (0, 2))], value, key_padding_mask=kpm,
                      causal=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_key_one_entry(backend):
    """A single NaN entry of a padded key's k and v rows, next to finite ones."""
    ts = _inputs(backend, 5, 7)
    kpm = torch.zeros(1, 7, dtype=torch.bool, device=ts[0].device)
    kpm[0, 4] = True
    _check_unaffected(backend, ts, [("v", (0, 4, 0, 1)), ("k", (0, 4, 0, 0))], float("nan"),
                      key_padding_mask=kpm, causal=False)


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_future_key(backend, value):
    """v of key 599 (Lk 600) non-finite under causal=True: only row 599 (Lq 600) sees it, so
    rows 0..598 equal the run with v[599] = 0 and row 599 is not finite. (Triton under the
    interpreter: Lk 100, mask-free interior tiles and masked diagonal ones, in seconds.)"""
    Lk = 100 if backend == "triton" else 600
    ts = _inputs(backend, Lk, Lk)
    with torch.no_grad():
        out0 = rel_attention(*_poison(ts, [("v", (0, Lk - 1))], 0.0), causal=True,
                             backend=backend)
        out = rel_attention(*_poison(ts, [("v", (0, Lk - 1))], value), causal=True,
                            backend=backend)
    _assert_same(backend, out[:, :-1], out0[:, :-1], "rows 0..598")
    assert not torch.isfinite(out[:, -1]).any(), "row 599 uses the non-finite v: not finite"


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["v", "k"])
def test_causal_future_keys_of_a_segment(backend, name, value):
    """Lq 4 < Lk 9 causal: keys past the last row's diagonal (none here) and a left window
    (window_size=(3, 0)): keys 0..1 are outside every row's window; their rows non-finite."""
    ts = _inputs(backend, 4, 9, R=12)
    _check_unaffected(backend, ts, [(name, (0, 0)), (name, (0, 1))], value,
                      window_size=(3, 0))


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Lq,Lk", [(4, 8), (48, 48)])
def test_r_rows_of_excluded_pairs(backend, Lq, Lk, value):
    """Causal, R = Lq + Lk - 1: r rows Lk.. serve only future (excluded) pairs (Lq 4, Lk 8:
    the issue's case; 48 x 48: the kernels' mask-free interior tiles too, whose r windows
    hold a row no pair of the tile uses)."""
    ts = _inputs(backend, Lq, Lk)
    _check_unaffected(backend, ts, [("r", slice(Lk, None))], value, causal=True)


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_row_without_allowed_key(backend, value):
    """Row 1 has no allowed key (attn_mask), key 3's v / k rows non-finite and masked for
    every row: row 1 is 0, every output and gradient as with those rows at 0."""
    ts = _inputs(backend, 4, 6)
    mask = torch.zeros(4, 6, dtype=torch.bool, device=ts[0].device)
    mask[1, :] = True
    mask[:, 3] = True
    entries = [("v", (0, 3)), ("k", (0, 3))]
    _check_unaffected(backend, ts, entries, value, attn_mask=mask, causal=False)
    out, g = _run(backend, _poison(ts, entries, value), attn_mask=mask, causal=False)
    assert (out[:, 1] == 0).all()
    assert (g[0][:, 1] == 0).all()


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_mask_and_window(backend, value):
    """attn_mask and a two-sided window exclude different pairs of the same key: keys 0 and
    5 are excluded for every row (window_size=(2, 1) around Lq = Lk = 6 ... plus the mask)."""
    ts = _inputs(backend, 6, 6, R=11)
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool, device=ts[0].device)
    mask[..., 0] = True
    mask[..., 5] = True
    entries = [("v", (0, 0)), ("k", (0, 5)), ("v", (0, 5)), ("k", (0, 0))]
    _check_unaffected(backend, ts, entries, value, attn_mask=mask, window_size=(2, 1))


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["v", "k", "r"])
def test_allowed_pair_stays_non_finite(backend, name, value):
    """Only query row 2 may see key 4 (attn_mask); a non-finite v / k row of key 4, or the r
    row of that pair, makes row 2's output non-finite and leaves every other row as it was."""
    ts = _inputs(backend, 5, 7)
    mask = torch.zeros(5, 7, dtype=torch.bool, device=ts[0].device)
    mask[:, 4] = True
    mask[2, 4] = False
    # r row of pair (2, 4): p = j - i + Lq - 1 = 6; pair (i, j) with j - i = 2 all use it, so
    # mask those other pairs too
    if name == "r":
        for i in range(5):
            if i + 2 < 7 and i != 2:
                mask[i, i + 2] = True
    entries = [(name, (6 if name == "r" else (0, 4)))]
    with torch.no_grad():
        out0 = rel_attention(*_poison(ts, entries, 0.0), attn_mask=mask, causal=False,
                             backend=backend)
        out = rel_attention(*_poison(ts, entries, value), attn_mask=mask, causal=False,
                            backend=backend)
    assert not torch.isfinite(out[:, 2]).all(), "row 2 uses the non-finite row"
    others = [0, 1, 3, 4]
    _assert_same(backend, out[:, others], out0[:, others], "other rows")
    # the gradients of that row are not finite either (the fused backward takes it from the
    # forward's lse: NaN, not the +inf of a row with no key)
    _, g = _run(backend, _poison(ts, entries, value), attn_mask=mask, causal=False)
    assert not torch.isfinite(g[0][:, 2]).all(), "dq of row 2"


def _memory_case(backend, seed, data_dtype):
    """fp32 ``(q, k, v, r, u, vb)`` (Lq = Lc = 4), a 3-row 8-bit memory of ``data_dtype`` and a
    key padding mask that pads memory row 1, on the backend's device."""
    dev, D = SETUP[backend][2], SETUP[backend][1]
    g = torch.Generator().manual_seed(seed)
    M, Lc, Lq = 3, 4, 4
    q, k, v = (torch.randn(1, L, 1, D, generator=g).to(dev) for L in (Lq, Lc, Lc))
    r = torch.randn(M + Lc + Lq - 1, 1, D, generator=g).to(dev)
    u, vb = (torch.randn(1, D, generator=g).to(dev) for _ in range(2))
    mem = quantize_kv(torch.randn(1, M, 1, D, generator=g).to(dev),
                      torch.randn(1, M, 1, D, generator=g).to(dev), data_dtype)
    kpm = torch.zeros(1, M + Lc, dtype=torch.bool, device=dev)
    kpm[0, 1] = True
    return (q, k, v, r, u, vb), mem, kpm


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
@pytest.mark.parametrize("scale_of", ["v_scale", "k_scale"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_8bit_memory_scale_of_padded_row(backend, scale_of, value):
    """An 8-bit memory (QuantizedKV) whose padded row 1 has a non-finite v_scale (or
    k_scale): the output (forward only) equals the one with that scale at 0."""
    (q, k, v, r, u, vb), mem, kpm = _memory_case(backend, 3, torch.int8)

    def run(x):
        scales = {"k_scale": mem.k_scale.clone(), "v_scale": mem.v_scale.clone()}
        scales[scale_of][0, 1, 0] = x
        m = QuantizedKV(mem.k, scales["k_scale"], mem.v, scales["v_scale"])
        with torch.no_grad():
            return rel_attention(q, k, v, r, u, vb, memory=m, key_padding_mask=kpm,
                                 causal=True, backend=backend)

    out0, out = run(0.0), run(value)
    assert torch.isfinite(out).all()
    _assert_same(backend, out, out0, "output")


# ------------------------------------------------ the einsum paths that are not the reference

@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process (the ring's einsum block math, one chunk pair)."""
    import torch.distributed as dist

    from helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
def test_context_parallel_einsum_blocks(world_of_one, value):
    """context_parallel_rel_attention(backend="reference"), memory 3 + segment 4, causal:
    padded key 1 (k and v rows non-finite) and r rows 7.. (future pairs only) non-finite."""
    from txl_kernels.distributed import context_parallel_rel_attention

    q, k, v, r, u, vb = make_inputs(1, 4, 7, 1, 4, R=10, dtype=torch.float64)
    kpm = torch.zeros(1, 7, dtype=torch.bool)
    kpm[0, 1] = True
    entries = [("k", (0, 1)), ("v", (0, 1)), ("r", slice(7, None))]

    def run(x):
        leaves = [t.detach().clone().requires_grad_() for t in _poison((q, k, v, r, u, vb),
                                                                       entries, x)]
        out = context_parallel_rel_attention(*leaves, mlen=3, causal=True,
                                             key_padding_mask=kpm, backend="reference")
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in leaves]

    (out0, g0), (out, g) = run(0.0), run(value)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out0, rtol=0, atol=0)
    for name, a, b in zip(NAMES, g, g0):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("value", VALUES, ids=VALUE_IDS)
def test_cached_attention_future_keys(value, backend):
    """The cached model's segment route on CPUs (causal over [cache; segment], the C++ kernel
    or the reference): a non-finite v of the last key reaches only the last row; with a left
    window, keys before every row's window (v non-finite) reach nothing."""
    from txl_kernels.cached_attention import cached_attention

    q, k, v, r, u, vb = make_inputs(1, 4, 9, 2, 4, R=9, dtype=torch.float64)
    for window_left, j, rows_hit in ((-1, 8, [3]), (3, 0, [])):
        v0, v1 = v.clone(), v.clone()
        v0[0, j] = 0.0
        v1[0, j] = value
        out0, out = (cached_attention(q, k, vv, r, u, vb, 0.5, (window_left, 0), backend=backend)
                     for vv in (v0, v1))
        rest = [i for i in range(4) if i not in rows_hit]
        torch.testing.assert_close(out[:, rest], out0[:, rest], rtol=0, atol=0)
        assert torch.isfinite(out[:, rest]).all()
        assert not torch.isfinite(out[:, rows_hit]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_allowed_nonfinite_v_on_every_tile(backend):
    """Causal 48 x 48 (the kernels' mask-free interior tiles and masked diagonal ones): v of
    key 0, which every row may see, is NaN: every output row and every row of dq is not
    finite (the fused backward, which takes V's finite part, learns it from the forward's
    lse and from delta = rowsum(dO * out))."""
    ts = _inputs(backend, 48, 48)
    out, g = _run(backend, _poison(ts, [("v", (0, 0))], float("nan")), causal=True)
    assert not torch.isfinite(out).all(dim=-1).any()
    assert not torch.isfinite(g[0]).all(dim=-1).any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_forward_tiles_and_splits(num_splits):
    """The Triton forward itself (16 x 16 tiles under the interpreter), causal 48 x 48, v of
    key 20 NaN: rows 32..47 see it in a mask-free interior tile, rows 20..31 in the masked
    diagonal tile (rows 16..19 of that tile exclude it), rows 0..15 never load it. Rows
    20..47 are not finite (lse too), rows 0..19 equal the run with v[20] = 0, with and
    without split-K."""
    from txl_kernels.ops.rel_attn_fwd import rel_attn_fwd

    ts = _inputs("triton", 48, 48)
    runs = [rel_attn_fwd(*_poison(ts, [("v", (0, 20))], x), 0.25, -1, 0,
                         num_splits=num_splits) for x in (0.0, float("nan"))]
    (out0, lse0), (out, lse) = runs
    _assert_same("triton", out[:, :20], out0[:, :20], "rows 0..19")
    _assert_same("triton", lse[..., :20], lse0[..., :20], "lse of rows 0..19")
    assert not torch.isfinite(out[:, 20:]).all(dim=-1).any(), "rows 20..47 see key 20"
    assert not torch.isfinite(lse[..., 20:]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_8bit_memory_fp8_values(backend):
    """A float8_e4m3fn memory (whose data can hold NaN): a NaN entry of padded row 1's v
    changes nothing; a NaN entry of row 0's v (allowed for every query row) or a
    non-finite v_scale of row 2 makes every output row non-finite."""
    (q, k, v, r, u, vb), mem, kpm = _memory_case(backend, 4, torch.float8_e4m3fn)

    def run(row, x, scale=None):
        data, v_scale = mem.v.clone(), mem.v_scale.clone()
        if scale is None:
            data[0, row, 0, 1] = x
        else:
            v_scale[0, row, 0] = scale
        m = QuantizedKV(mem.k, mem.k_scale, data, v_scale)
        with torch.no_grad():
            return rel_attention(q, k, v, r, u, vb, memory=m, key_padding_mask=kpm,
                                 causal=True, backend=backend)

    out0, out = run(1, 0.0), run(1, float("nan"))
    assert torch.isfinite(out).all()
    _assert_same(backend, out, out0, "output")
    assert not torch.isfinite(run(0, float("nan"))).all(dim=-1).any()
    assert not torch.isfinite(run(2, 0.0, float("inf"))).all(dim=-1).any()
