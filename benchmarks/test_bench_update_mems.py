"""update_mems against the per-layer torch.cat + slice loop, at 4, 16 and 32 layers."""
import pytest

from benchmarks import shapes
from benchmarks._bench import run

CASES = shapes.mems_cases("cuda") + shapes.mems_cases("cpu")


@pytest.mark.parametrize("provider", shapes.PROVIDER_ORDER["update_mems"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_update_mems(benchmark, case, provider):
    run(benchmark, case, provider)
