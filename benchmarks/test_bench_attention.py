"""Attention level: every provider on the same inputs (shapes.attention_cases)."""
import pytest

from benchmarks import shapes
from benchmarks._bench import run

CASES = shapes.attention_cases("cuda") + shapes.attention_cases("cpu")


@pytest.mark.parametrize("provider", shapes.PROVIDER_ORDER["attention"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_attention(benchmark, case, provider):
    run(benchmark, case, provider)
