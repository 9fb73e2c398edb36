"""The fused CPU kernel (csrc/rel_attention_cpu.cpp, backend="cpu"): forward and every gradient
against the float64 reference, every mask kind, odd sizes, dtypes, thread counts, dropout, the
8-bit memory, the torch.library registrations and backend="auto" routing. The correctness
tests run on every ISA variant of the row code that the machine runs (the cpu_isa fixture) and,
for fp32, on both GEMM libraries (the cpu_fp32_gemm fixture); the choice of the variant itself
is tested at the end."""
import pytest
import torch

import txl_kernels
import txl_kernels.functional as F
from txl_kernels import mask_to_band, quantize_kv, rel_attention
from txl_kernels.reference import rel_attention_reference

from helpers import assert_within, make_inputs, oracle


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel(extension):
    from txl_kernels.cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()
    assert ok, why


def _masks(kind, B, H, Lq, Lk, seed=0):
    """(causal, window, key_padding_mask, attn_mask, band) for one mask kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == "causal":
        return True, (-1, -1), None, None, False
    if kind == "full":
        return False, (-1, -1), None, None, False
    if kind == "window":
        return True, (9, 0), None, None, False
    if kind == "window2":
        return False, (6, 4), None, None, False
    if kind == "padding":  # batch 1 fully padded: rows without any key
        kpm = torch.rand(B, Lk, generator=g) < 0.3
        kpm[-1] = True
        return True, (-1, -1), kpm, None, False
    if kind == "dense":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) < 0.4
        mask[0, 0, 1] = True  # a fully masked row
        return False, (-1, -1), None, mask, False
    if kind == "band":  # a sliding-window mask passed densely with its band descriptor
        d = (torch.arange(Lq)[:, None] + Lk - Lq) - torch.arange(Lk)
        return False, (-1, -1), None, (d > 5) | (d < -2), True
    raise ValueError(kind)


def _run(B, Lq, Lk, H, D, kind, dtype=torch.float32, layout="bshd", grads=True, seed=0):
    causal, window, kpm, mask, band = _masks(kind, B, H, Lq, Lk, seed)
    R = Lk + Lq - 1
    ts = make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, layout=layout, seed=seed,
                     requires_grad=grads)
    kw = dict(causal=causal, window_size=window, key_padding_mask=kpm, attn_mask=mask,
              attn_mask_band=mask_to_band(mask) if band else None)
    out = rel_attention(*ts, backend="cpu", **kw)
    ref_in = [t.detach().requires_grad_(grads) for t in ts]
    same = rel_attention(*ref_in, backend="reference", **kw)
    wr = 0 if causal else window[1]
    full_mask = None if mask is None else mask.expand(B, H, Lq, Lk)
    up, truth = oracle(*ts, D ** -0.5, window[0], wr, kpm, full_mask)
    return ts, out, (ref_in, same), up, truth


def _check_all(ts, out, ref, up, truth):
    """out and the six gradients within twice the error of torch's same-precision math."""
    ref_in, same = ref
    assert_within("out", out, same, truth)
    # a fixed upstream gradient: the result must not depend on the tests run before
    g = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0), dtype=truth.dtype)
    grads = torch.autograd.grad(out, ts, g.to(out.dtype))
    ref_grads = torch.autograd.grad(same, ref_in, g.to(out.dtype))
    truth_grads = torch.autograd.grad(truth, up, g)
    for name, a, b, c in zip(("dq", "dk", "dv", "dr", "dr_w_bias", "dr_r_bias"), grads,
                             ref_grads, truth_grads):
        assert a.shape == c.shape and a.dtype == out.dtype, name
        assert_within(name, a, b, c)


# fp32 calls take the brgemm route from this many query rows (csrc: kFp32BrgemmMinRows)
FP32_BRGEMM_MIN_ROWS = 129

CASES = [  # (B, Lq, Lk, H, D, mask kind)
    (2, 37, 37, 2, 41, "causal"),
    (1, 37, 600, 2, 41, "causal"),     # memory longer than the segment, several key tiles
    (1, 1, 1, 1, 16, "causal"),
    (1, 1, 37, 1, 16, "full"),
    (2, 37, 53, 2, 16, "full"),
    (1, 300, 620, 1, 32, "window"),    # several query blocks, skipped key tiles
    (1, 300, 700, 1, 32, "full"),      # several query blocks and key tiles, partial last ones
    (1, 300, 2100, 1, 16, "window"),   # long key ranges: the forward's 256-row query blocks
    (1, 300, 2100, 1, 16, "full"),
    (1, 37, 45, 2, 24, "window2"),
    (2, 150, 150, 3, 41, "window2"),   # band tiles: 64-row blocks, heads innermost, B > 1
    (2, 37, 53, 2, 16, "padding"),
    (2, 37, 53, 2, 16, "dense"),
    (2, 37, 53, 2, 16, "band"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[-1]}-{c[1]}x{c[2]}-D{c[4]}" for c in CASES])
def test_forward_and_gradients_match_float64_reference(case, cpu_isa, cpu_fp32_gemm):
    ops = torch.ops.txl_kernels
    brgemm = cpu_fp32_gemm == "brgemm" and cpu_isa != "default"
    assert ops.cpu_lowp_route(torch.float32) == ("brgemm (fp32)" if brgemm else "native")
    brgemm &= case[1] >= FP32_BRGEMM_MIN_ROWS  # shorter calls stay on the BLAS
    calls, res = _brgemm_calls_during(lambda: _run(*case))
    assert calls == brgemm  # the forward
    calls, _ = _brgemm_calls_during(lambda: _check_all(*res))
    assert calls == brgemm  # the backward


def test_fully_masked_rows_give_zero_output_and_zero_gradients(cpu_isa):
    ts, out, *_ = _run(2, 37, 53, 2, 16, "padding")
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # batch 1: every key padded
    out[-1].sum().backward()
    assert all(t.grad is None or not t.grad.abs().sum() for t in ts)
    ts, out, *_ = _run(2, 37, 53, 2, 16, "dense")
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_the_error_of_torch(dtype, cpu_isa):
    _check_all(*_run(2, 37, 70, 2, 41, "causal", dtype=dtype))
    _check_all(*_run(1, 37, 53, 2, 24, "dense", dtype=dtype))
    _check_all(*_run(2, 100, 100, 2, 41, "window2", dtype=dtype))  # band tiles


def test_float64_matches_reference_closely():
    ts, out, same, up, truth = _run(1, 37, 53, 2, 41, "full", dtype=torch.float64)
    torch.testing.assert_close(out, truth.detach(), rtol=1e-10, atol=1e-12)
    # a fixed upstream gradient: the result must not depend on the tests run before
    g = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0), dtype=truth.dtype)
    for a, b in zip(torch.autograd.grad(out, ts, g), torch.autograd.grad(truth, up, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def _brgemm_calls_during(fn):
    ops = torch.ops.txl_kernels
    before = ops.cpu_brgemm_calls()
    res = fn()
    return ops.cpu_brgemm_calls() - before, res


def test_low_precision_route_follows_the_isa_variant(cpu_isa):
    """bf16 / fp16 take brgemm (AMX) only under the AVX-512 variant on a CPU whose oneDNN packs
    the dtype (cpublas::could_pack); elsewhere, and under the avx2 / default override, the fp32
    tiles; fp32 / fp64 are untouched (fp32 forced onto the BLAS here)."""
    ops = torch.ops.txl_kernels
    ops.cpu_fp32_gemm_override("blas")
    try:
        assert ops.cpu_lowp_route(torch.float32) == ops.cpu_lowp_route(torch.float64) == "native"
        ts = make_inputs(1, 5, 9, 1, 16, dtype=torch.bfloat16)
        calls, _ = _brgemm_calls_during(lambda: rel_attention(*ts, backend="cpu"))
        route = ops.cpu_lowp_route(torch.bfloat16)
        assert route in ("brgemm (AMX)", "fp32 tiles")
        assert calls == (route == "brgemm (AMX)")
        if cpu_isa != "avx512":
            assert route == ops.cpu_lowp_route(torch.float16) == "fp32 tiles"
        calls, _ = _brgemm_calls_during(
            lambda: rel_attention(*[t.float() for t in ts], backend="cpu"))
        assert calls == 0
    finally:
        ops.cpu_fp32_gemm_override("")


def test_fp32_gemm_choice_and_its_override():
    """The fp32 GEMM library: TXL_KERNELS_CPU_GEMM where set, else oneDNN's brgemm on non-Intel
    x86 CPUs with MKL as the BLAS; the test-only override forces either and "" restores the
    process's choice; anything else is refused, naming what it takes."""
    import os
    import platform

    ops = torch.ops.txl_kernels
    own = ops.cpu_fp32_gemm()
    assert own in ("blas", "brgemm")
    env = os.environ.get("TXL_KERNELS_CPU_GEMM", "auto")
    if env in ("blas", "brgemm") and own != env:
        assert env == "brgemm"  # brgemm asked for, but it does not run here
    if env == "auto" and own == "brgemm":
        with open("/proc/cpuinfo") as f:
            assert "GenuineIntel" not in f.read() and platform.machine() in ("x86_64", "AMD64")
    with pytest.raises(ValueError, match="cpu_fp32_gemm_override: which must be"):
        ops.cpu_fp32_gemm_override("mkl")
    try:
        assert ops.cpu_fp32_gemm_override("blas") == "blas"
        assert ops.cpu_lowp_route(torch.float32) == "native"
    finally:
        assert ops.cpu_fp32_gemm_override("") == own


def test_fp32_brgemm_keeps_non_finite_masked_values_out(cpu_fp32_gemm):
    """On either fp32 GEMM library a padded key's inf value reaches no output and no gradient,
    and a key's inf value reaches exactly the rows that attend it (the flagged-row path of the
    forward's P V and of the backward's dO V^T)."""
    B, Lq, H, D = 2, FP32_BRGEMM_MIN_ROWS, 2, 41
    ts = make_inputs(B, Lq, Lq, H, D, R=2 * Lq - 1, requires_grad=True)
    with torch.no_grad():
        ts[2][0, 3, 1, 5] = float("inf")
    kpm = torch.zeros(B, Lq, dtype=torch.bool)
    kpm[0, 3] = True
    out = rel_attention(*ts, backend="cpu", key_padding_mask=kpm, causal=False)
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out, ts, torch.ones_like(out))
    for name, gr in zip(("dq", "dk", "dv", "dr", "du", "dvb"), grads):
        assert torch.isfinite(gr).all() or name == "dv", name  # dv of the inf entry: 0 * inf
    kpm[0, 3] = False
    out = rel_attention(*ts, backend="cpu", key_padding_mask=kpm, window_size=(Lq, 0))
    bad = ~torch.isfinite(out)
    assert bad[0, 3:, 1, 5].all() and bad.sum() == Lq - 3  # the queries that attend key 3


def _need_brgemm():
    ops = torch.ops.txl_kernels
    if "avx512" not in ops.cpu_isa_supported():
        pytest.skip("the brgemm route needs the AVX-512 variant, which this CPU cannot run")
    assert ops.cpu_isa_override("avx512") == "avx512"
    if ops.cpu_lowp_route(torch.bfloat16) != "brgemm (AMX)":
        ops.cpu_isa_override("")
        pytest.skip("this CPU's oneDNN does not pack bf16 for brgemm (no AMX-BF16)")


BRGEMM_CASES = [  # (B, Lq, Lk, H, D, mask kind): odd head dim and lengths, every mask kind
    (2, 37, 70, 2, 41, "causal"),
    (1, 37, 600, 2, 41, "causal"),    # several key tiles, the window shifted between them
    (1, 1, 37, 1, 41, "full"),
    (1, 1, 1, 1, 41, "causal"),
    (2, 37, 53, 2, 41, "full"),
    (1, 37, 45, 2, 41, "window2"),
    (1, 37, 53, 1, 41, "window"),
    (2, 37, 53, 2, 41, "padding"),    # masked tiles: v rows go through the flagged-row path
    (1, 37, 53, 2, 16, "dense"),
]


@pytest.mark.parametrize("case", BRGEMM_CASES,
                         ids=[f"{c[-1]}-{c[1]}x{c[2]}-D{c[4]}" for c in BRGEMM_CASES])
def test_bf16_brgemm_route_within_twice_the_error_of_torch(case):
    """Issue #41 item 2: on the brgemm route (bf16 operands, fp32 accumulation; the forward's P
    rounded to bf16 before P V; the backward's scores and dO V^T) the output and the six
    gradients stay within twice torch's own bf16 error. The output gradient is drawn from a
    fixed seed: the backward exceeds twice torch's error on some draws at these sizes on the
    fp32 tiles as well."""
    _need_brgemm()
    try:
        calls, res = _brgemm_calls_during(lambda: _run(*case, dtype=torch.bfloat16))
        assert calls == 1  # the forward
        torch.manual_seed(0)
        calls, _ = _brgemm_calls_during(lambda: _check_all(*res))
        assert calls == 1  # the backward
    finally:
        torch.ops.txl_kernels.cpu_isa_override("")


def test_bf16_brgemm_route_reads_the_8bit_memory_and_non_finite_masked_values():
    """The memory rows are dequantised to bf16 for brgemm's packed panels, and a key's inf
    value reaches only the rows allowed it, as on the fp32 tiles: in the forward, and in the
    backward's dO V^T, where a padded key's inf reaches no gradient."""
    _need_brgemm()
    ops = torch.ops.txl_kernels
    try:
        B, Lq, M, H, D = 2, 13, 40, 2, 41
        g = torch.Generator().manual_seed(3)
        mk, mv = (torch.randn(B, M, H, D, generator=g) for _ in range(2))
        ts = make_inputs(B, Lq, Lq, H, D, R=M + Lq, dtype=torch.bfloat16)
        ts[2][0, 3, 1, 5] = float("inf")  # key M + 3 of batch 0, head 1
        kpm = torch.rand(B, M + Lq, generator=g) < 0.2
        kpm[0, M + 3] = False
        kw = dict(memory=quantize_kv(mk, mv, torch.int8, torch.float32), window_size=(30, 0),
                  key_padding_mask=kpm)
        calls, out = _brgemm_calls_during(lambda: rel_attention(*ts, backend="cpu", **kw))
        assert calls == 1
        ops.cpu_isa_override("avx2")
        tiles = rel_attention(*ts, backend="cpu", **kw)
        bad = ~torch.isfinite(tiles)
        assert bad[0, 3:, 1, 5].all() and bad.sum() == Lq - 3  # the queries that attend it
        assert torch.equal(~torch.isfinite(out), bad)
        torch.testing.assert_close(out[~bad], tiles[~bad], rtol=2e-2, atol=2e-2)
        # backward: key 3 of batch 0 padded, its inf value in head 1
        ts = make_inputs(B, Lq, Lq, H, D, R=2 * Lq - 1, dtype=torch.bfloat16, requires_grad=True)
        with torch.no_grad():
            ts[2][0, 3, 1, 5] = float("inf")
        kpm = torch.zeros(B, Lq, dtype=torch.bool)
        kpm[0, 3] = True
        grads = []
        for isa in ("avx512", "avx2"):
            ops.cpu_isa_override(isa)
            out = rel_attention(*ts, backend="cpu", key_padding_mask=kpm, causal=False)
            calls, gs = _brgemm_calls_during(
                lambda: torch.autograd.grad(out, ts, torch.ones_like(out)))
            assert calls == (isa == "avx512")
            grads.append(gs)
        for name, a, b in zip(("dq", "dk", "dv", "dr", "du", "dvb"), *grads):
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), name
            assert finite.all() or name == "dv", name  # dv of the inf entry: 0 * inf
            torch.testing.assert_close(a[finite], b[finite], rtol=3e-2, atol=3e-2, msg=name)
    finally:
        ops.cpu_isa_override("")


def test_fp32_brgemm_saturated_softmax_backward_matches_reference(cpu_fp32_gemm):
    """The saturated-softmax backward (below) on a call long enough for the fp32 brgemm route:
    the backward recomputes the forward's scores bit for bit, so a saturated row's P is exactly
    1 and its dS 0 on either GEMM library."""
    L = FP32_BRGEMM_MIN_ROWS
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(*s, generator=g) for s in ((1, L, 1, 8), (1, L, 1, 8), (1, L, 1, 8),
                                                 (2 * L - 1, 1, 8), (1, 8), (1, 8))]
    res = []
    for backend in ("cpu", "reference"):
        xs = [t.clone().requires_grad_() for t in ts]
        calls, out = _brgemm_calls_during(
            lambda: rel_attention(*xs, causal=False, softmax_scale=3e5, backend=backend))
        assert calls == (backend == "cpu" and cpu_fp32_gemm == "brgemm"
                         and torch.ops.txl_kernels.cpu_isa() != "default")
        out.sum().backward()
        res.append([out.detach()] + [x.grad for x in xs])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dr", "du", "dvb"), *res):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * max(1.0, b.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("dtype, scale, magnitude, tol", [
    (torch.float64, 1e20, 1.0, 1e-6), (torch.float32, 3e5, 1.0, 1e-2),
    (torch.float32, 300.0, 1.0, 1e-4), (torch.float64, None, 1e150, 1e-6),
    (torch.float64, 1.0, 1e150, 1e-6)])
def test_saturated_softmax_backward_matches_reference(dtype, scale, magnitude, tol, cpu_isa):
    """Issue #42 item 2: where the softmax saturates (one key takes all the weight) the
    backward recomputes P = 1 exactly and the row's dS is 0, as the reference's is: no NaN /
    inf, and no scale-amplified rounding of dP - rowsum(dO * O)."""
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        ts = [torch.randn(*s, generator=g, dtype=dtype) * magnitude
              for s in ((1, 6, 1, 8), (1, 10, 1, 8), (1, 10, 1, 8), (15, 1, 8), (1, 8), (1, 8))]
        go = (torch.ones(1, 6, 1, 8, dtype=dtype) if seed % 2 == 0
              else torch.randn(1, 6, 1, 8, generator=g, dtype=dtype))
        res = []
        for backend in ("cpu", "reference"):
            xs = [t.clone().requires_grad_() for t in ts]
            out = rel_attention(*xs, causal=False, softmax_scale=scale, backend=backend)
            (out * go).sum().backward()
            res.append((out.detach(), [x.grad for x in xs]))
        (out, grads), (want, wgrads) = res
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
        for name, got, ref in zip(("q", "k", "v", "r", "r_w_bias", "r_r_bias"), grads, wgrads):
            assert torch.isfinite(got).all(), f"seed {seed}: d{name} not finite"
            torch.testing.assert_close(got, ref, rtol=0, atol=tol, msg=f"seed {seed}: d{name}")


def test_strided_inputs_give_the_contiguous_result():
    """Seq-first storage passed as transpose(0, 1) views (stride(-1) == 1) is read in place."""
    ts = make_inputs(2, 37, 53, 2, 16, layout="sbhd", requires_grad=True)
    assert not ts[0].is_contiguous()
    dense = [t.detach().contiguous().requires_grad_(True) for t in ts]
    a, b = (rel_attention(*x, backend="cpu") for x in (ts, dense))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(a)
    for x, y in zip(torch.autograd.grad(a, ts, g), torch.autograd.grad(b, dense, g)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_deterministic_and_the_same_for_one_and_several_threads():
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3, 1):
            torch.set_num_threads(n)
            ts = make_inputs(2, 200, 300, 3, 32, R=499, requires_grad=True)
            out = rel_attention(*ts, backend="cpu", causal=False)
            out.square().sum().backward()
            results.append([out.detach()] + [t.grad for t in ts])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


@pytest.mark.parametrize("kind", ["causal", "full", "window"])
def test_backward_splits_query_blocks_over_threads_when_heads_are_few(kind):
    """With fewer (batch, head) pairs than threads the backward deals each pair's query blocks
    to several tasks with their own dk / dv / dr accumulators (summed in a fixed order): the
    gradients still match the float64 oracle, and repeat bitwise at a given thread count."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # 1 pair, 3 query blocks of 128 rows: three splits
        _check_all(*_run(1, 300, 340, 1, 41, kind))
        grads = []
        for _ in range(2):
            ts = make_inputs(1, 300, 340, 1, 41, R=639, requires_grad=True)
            rel_attention(*ts, backend="cpu", causal=False).square().sum().backward()
            grads.append([t.grad for t in ts])
        for x, y in zip(*grads):
            assert torch.equal(x, y)
    finally:
        torch.set_num_threads(threads)


def test_kernel_runs_on_torch_intra_op_threads():
    """at::parallel_for in the extension splits the work over torch.set_num_threads threads
    (it needs the extension compiled with OpenMP: otherwise one thread does everything)."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.ops.txl_kernels.rel_attn_cpu_threads() == n
    finally:
        torch.set_num_threads(threads)


def test_8bit_memory_forward_matches_reference(cpu_isa):
    B, Lq, M, H, D = 2, 13, 40, 2, 32
    g = torch.Generator().manual_seed(3)
    mk, mv = (torch.randn(B, M, H, D, generator=g) for _ in range(2))
    q, k, v, r, u, vb = make_inputs(B, Lq, Lq, H, D, R=M + Lq)
    for qdtype, scale_dtype in ((torch.int8, torch.float32), (torch.float8_e4m3fn, torch.float16)):
        mem = quantize_kv(mk, mv, qdtype, scale_dtype)
        kpm = torch.rand(B, M + Lq, generator=g) < 0.2
        kw = dict(memory=mem, window_size=(30, 0), key_padding_mask=kpm)
        out = rel_attention(q, k, v, r, u, vb, backend="cpu", **kw)
        want = rel_attention(q, k, v, r, u, vb, backend="reference", **kw)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="forward only"):
        rel_attention(q, k, v, r, u, vb, memory=mem, backend="cpu")
    # auto: gradients recorded with an 8-bit memory go to the reference
    out = rel_attention(q, k, v, r, u, vb, memory=mem, backend="reference")
    torch.testing.assert_close(
        _auto(q, k, v, r, u, vb, memory=mem), out, rtol=0, atol=0)


def _auto(*args, **kw):
    import unittest.mock as mock

    with mock.patch.object(F, "interpreting", lambda: False), \
            mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}):
        return rel_attention(*args, backend="auto", **kw)


def test_dropout_uses_the_triton_keep_mask_and_is_reproducible(cpu_isa):
    from txl_kernels.ops._common import dropout_keep_mask  # the Triton kernels' mask

    B, Lq, Lk, H, D, p = 2, 21, 50, 2, 16, 0.3
    ts = make_inputs(B, Lq, Lk, H, D, requires_grad=True)
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    from txl_kernels._op import rel_attn_func

    out = rel_attn_func(*ts, D ** -0.5, -1, 0, dropout_p=p, dropout_seed=seed)
    keep = dropout_keep_mask(seed, B, H, Lq, Lk, p)
    up = [t.detach().double().requires_grad_(True) for t in ts]
    truth = rel_attention_reference(*up, D ** -0.5, -1, 0, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5)
    # a fixed upstream gradient: the result must not depend on the tests run before
    g = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0), dtype=truth.dtype)
    for a, b in zip(torch.autograd.grad(out, ts, g.float()), torch.autograd.grad(truth, up, g)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    # through rel_attention: torch.manual_seed reproduces, consecutive calls differ
    torch.manual_seed(7)
    a = rel_attention(*ts, backend="cpu", dropout_p=p)
    b = rel_attention(*ts, backend="cpu", dropout_p=p)
    torch.manual_seed(7)
    a2 = rel_attention(*ts, backend="cpu", dropout_p=p)
    assert torch.equal(a, a2) and not torch.equal(a, b)


def test_bad_input_names_the_argument():
    q, k, v, r, u, vb = make_inputs(1, 5, 7, 1, 16)
    op = torch.ops.txl_kernels.rel_attn_fwd
    rest = (0.25, -1, 0, None, None, None, 0.0, None, None, None, None, None)
    with pytest.raises(RuntimeError, match="k has dtype"):
        op(q, k.double(), v, r, u, vb, *rest)
    with pytest.raises(RuntimeError, match="r must be"):
        op(q, k, v, r[:, :, :8], u, vb, *rest)
    with pytest.raises(RuntimeError, match="dropout_seed"):
        op(q, k, v, r, u, vb, 0.25, -1, 0, None, None, None, 0.5, None, None, None, None, None)
    with pytest.raises(RuntimeError, match="key_padding_mask"):
        op(q, k, v, r, u, vb, 0.25, -1, 0, torch.zeros(1, 3, dtype=torch.bool), None, None,
           0.0, None, None, None, None, None)
    with pytest.raises(ValueError, match="backend must be one of"):
        rel_attention(q, k, v, r, u, vb, backend="cpp")


def test_opcheck_forward_and_backward():
    q, k, v, r, u, vb = make_inputs(2, 9, 13, 2, 16, R=21, layout="sbhd", requires_grad=True)
    kpm = torch.rand(2, 13) < 0.2
    mask = (torch.rand(1, 1, 9, 13) < 0.3).expand(2, 2, 9, 13)
    args = (q, k, v, r, u, vb, 0.25, 5, -1, kpm, mask, None, 0.0, None, None, None, None, None)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default, args)
    with torch.no_grad():
        out, lse = torch.ops.txl_kernels.rel_attn_fwd(*args)
    det = [t.detach() for t in (q, k, v, r, u, vb)]
    bargs = (torch.randn_like(out), *det, out, lse, 0.25, 5, -1, kpm, mask, None, True, 0.0,
             None)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_bwd.default, bargs)


def test_compile_fullgraph_forward_and_backward():
    ts = make_inputs(2, 7, 11, 2, 16, requires_grad=True)

    def f(q, k, v, r, u, vb):
        return rel_attention(q, k, v, r, u, vb, window_size=(5, 0), backend="cpu") * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*ts)
    want = f(*ts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, ts, g), torch.autograd.grad(want, ts, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_on_cpu_takes_the_cpu_kernel_and_falls_back_with_a_warning(monkeypatch):
    import txl_kernels.cpu_kernel as ck
    import txl_kernels._cpp_ops as cpp_ops

    ts = make_inputs(1, 20, 30, 2, 16)
    assert torch.equal(_auto(*ts), rel_attention(*ts, backend="cpu"))
    monkeypatch.setattr(ck, "_STATE", (False, "no compiler here"))
    monkeypatch.setattr(cpp_ops, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        got = _auto(*ts)
    assert torch.equal(got, rel_attention(*ts, backend="reference"))
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run here: no compiler here"):
        rel_attention(*ts, backend="cpu")


def _isa_in_fresh_process(**env_extra):
    """(ATen's CPU capability, the CPU kernel's ISA variant) in a fresh process with
    ``env_extra`` set, after one call of the kernel."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(env_extra, PYTHONPATH=str(root))
    code = ("import torch; from txl_kernels import rel_attention; "
            "ts = [torch.randn(*s) for s in ((1, 9, 1, 8), (1, 9, 1, 8), (1, 9, 1, 8), "
            "(17, 1, 8), (1, 8), (1, 8))]; rel_attention(*ts, backend='cpu'); "
            "print(torch.backends.cpu.get_cpu_capability(), torch.ops.txl_kernels.cpu_isa())")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return tuple(r.stdout.split()[-2:])


@pytest.mark.parametrize("aten", [None, "default", "avx2", "avx512"])
def test_isa_variant_is_atens_choice_in_a_fresh_process(aten, extension):
    """The row code's variant is ATen's pick, the user's switch ATEN_CPU_CAPABILITY
    included (read once per process): default selects the baseline, avx2 the AVX2 variant."""
    supported = torch.ops.txl_kernels.cpu_isa_supported()
    if aten is not None and aten not in supported:
        pytest.skip(f"this CPU cannot run the {aten} variant (it runs {supported})")
    cap, isa = _isa_in_fresh_process(**({} if aten is None else {"ATEN_CPU_CAPABILITY": aten}))
    assert isa == cap.lower(), (cap, isa)
    if aten is not None:
        assert isa == aten


def test_isa_override_forces_a_variant_and_names_a_bad_one(extension):
    ops = torch.ops.txl_kernels
    aten = ops.cpu_isa()
    assert aten == torch.backends.cpu.get_cpu_capability().lower()
    try:
        assert ops.cpu_isa_override("default") == "default" == ops.cpu_isa()
        with pytest.raises(ValueError, match='isa must be "avx512", "avx2", "default" or "" '
                                             r'\(ATen\'s choice\), got "sse9"'):
            ops.cpu_isa_override("sse9")
        assert ops.cpu_isa() == "default"
    finally:
        assert ops.cpu_isa_override("") == aten


@pytest.mark.slow  # the whole main job (layer check, LM report): about two minutes here
def test_main_reports_and_checks_the_cpu_kernel(capsys):
    import txl_kernels.__main__ as main_mod

    assert main_mod.main([]) == 0
    out = capsys.readouterr().out
    assert "OK: every usable backend agrees" in out
    assert "backends" in out and "reference" in out and "triton" in out
    assert "cpu attention kernel" in out and "built: loaded" in out
    isa = torch.ops.txl_kernels.cpu_isa()
    assert (f"{'cpu kernel ISA variant':<28} {isa} (ATen's CPU capability: "
            f"{torch.backends.cpu.get_cpu_capability()})") in out
    route = torch.ops.txl_kernels.cpu_lowp_route
    assert (f"{'cpu kernel bf16 / fp16':<28} bf16: {route(torch.bfloat16)}, "
            f"fp16: {route(torch.float16)}") in out
    assert any(line.split()[:1] == ["cpu"] for line in out.splitlines())  # the layer check row
