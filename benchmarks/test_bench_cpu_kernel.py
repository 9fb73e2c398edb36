"""The fused CPU kernel (``rel_attention(backend="cpu")``) against the reference path, NeMo's
SDPA path (BD built densely as a float mask), NeMo's eager matmul path and SDPA without a
position term, on the same inputs, at one thread and at every core (shapes.cpu_kernel_cases).

``pytest benchmarks/test_bench_cpu_kernel.py --benchmark-only`` runs short lengths (CI);
``TXL_BENCH_CPU_KERNEL=issue`` the issue's shapes (T up to 16,384; about six minutes on two
idle cores), ``TXL_BENCH_CPU_KERNEL=full`` every mode at every thread count with more rounds.
The target ratios are printed at the end (benchmarks/cpu_suite.py). A dense baseline that
would not fit in memory is skipped up front with its estimated bytes.
"""
import pytest

from benchmarks import cpu_suite, shapes
from benchmarks._bench import run

CASES = shapes.cpu_kernel_cases(dtypes=cpu_suite.cpu_dtypes())


@pytest.mark.parametrize("provider", shapes.PROVIDER_ORDER["cpu_attention"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cpu_kernel(benchmark, case, provider):
    run(benchmark, case, provider)
