"""Test setup: without a CUDA device, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported; torch itself does not import triton.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

# the repository root, so that tests import the benchmark scripts (``from benchmarks import``)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

HAS_CUDA = torch.cuda.is_available()
# Under pytest-xdist (`-n auto`: one test process per core) each process keeps to its share of
# the cores: torch's default, every core in every process, oversubscribes the machine (one
# process's OpenMP threads spin on the cores the others run on). Tests that time or split work
# over threads set their own count.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_cores or 1) // _XDIST_WORKERS))
# The fused kernels' first-use self-check (txl_kernels.selfcheck) is off for the suite: the tests
# compare every fused path with the reference themselves; tests/test_selfcheck.py turns it on.
os.environ.setdefault("TXL_KERNELS_SELFCHECK", "0")
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Import triton now, while the variable holds: @triton.jit reads it when a kernel is created,
# triton's own tl.* helpers included, so a test that later sets TRITON_INTERPRET=0 for a moment
# (to check what happens without the interpreter) cannot leave compiled helpers behind.
import triton  # noqa: E402,F401

# The interpreter's int32 overflow check is off unless TXL_TESTS_SANITIZE_OVERFLOW=1: the slow
# stage runs the kernel tests with it (tests/test_interpreter_speed.py).
if os.environ.get("TRITON_INTERPRET") == "1":
    import _interpreter_speed

    _interpreter_speed.install()
    _interpreter_speed.sanitize_overflow(
        os.environ.get(_interpreter_speed.SANITIZE_OVERFLOW_ENV) == "1")


@pytest.fixture(scope="session")
def extension():
    """The compiled C++/CUDA extension, built (or found in torch's cache) once per test run;
    a machine that should build it and does not fails, one that cannot skips with the reason."""
    from txl_kernels import _build, _cpp_ops

    mod = _cpp_ops.load_extension()  # the ops' fake implementations registered too
    if mod is None:
        st = _build.extension_status()
        if st["buildable"]:
            pytest.fail(f"the C++ extension should build here but did not: {st['reason']}\n"
                        f"{st['log']}")
        pytest.skip(f"the C++ extension cannot be built here: {st['reason']}")
    return mod


# The ISA variants of the CPU kernels' row code (docs/cpu.md, "ISA variants").
CPU_ISAS = ["avx512", "avx2", "default"]


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request, extension):
    """Runs a CPU-kernel test once per ISA variant of the kernels' row code that this machine
    runs, forced with the test-only ``cpu_isa_override`` op (ATen's choice is restored after);
    a variant this CPU cannot run is skipped with the reason."""
    ops = torch.ops.txl_kernels
    if request.param not in ops.cpu_isa_supported():
        pytest.skip(f"this CPU cannot run the {request.param} variant "
                    f"(it runs {ops.cpu_isa_supported()})")
    assert ops.cpu_isa_override(request.param) == request.param
    yield request.param
    ops.cpu_isa_override("")


# The fp32 GEMM libraries of the CPU kernels (docs/cpu.md, "fp32 GEMMs").
CPU_FP32_GEMMS = ["blas", "brgemm"]


@pytest.fixture(params=CPU_FP32_GEMMS)
def cpu_fp32_gemm(request, extension):
    """Runs a CPU-kernel test once per fp32 GEMM library (the BLAS, oneDNN's fp32 brgemm),
    forced with the test-only ``cpu_fp32_gemm_override`` op (the process's choice is restored
    after); brgemm is skipped, with the reason, where this torch and CPU cannot run it."""
    ops = torch.ops.txl_kernels
    try:
        assert ops.cpu_fp32_gemm_override(request.param) == request.param
    except ValueError as e:
        pytest.skip(str(e))
    yield request.param
    ops.cpu_fp32_gemm_override("")
