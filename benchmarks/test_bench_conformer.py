"""Conformer module level (projections included): the NeMo and ESPnet drop-ins on the fused
and the reference backend, and NeMo's SDPA algorithm with the same weights."""
import pytest

from benchmarks import shapes
from benchmarks._bench import run

CASES = shapes.module_cases("cuda") + shapes.module_cases("cpu")


@pytest.mark.parametrize("provider", shapes.PROVIDER_ORDER["conformer_module"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformer_module(benchmark, case, provider):
    run(benchmark, case, provider)
