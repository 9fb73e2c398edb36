"""pytest-benchmark glue: group ratios at session end, and the markdown tables in the summary.

``pytest benchmarks/ --benchmark-only``: on a GPU machine the full matrix; without a GPU a
small CPU subset (reference, sdpa_bias, sdpa_plain at small shapes, update_mems), the GPU-only
providers and shapes skipped with a reason. The fused path is never timed under the Triton
interpreter. This conftest does not set TRITON_INTERPRET (tests/conftest.py does, for tests).
"""
import pytest

from benchmarks import results, runner


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # Before pytest-benchmark's own sessionfinish saves the JSON: the ratios are written into
    # each benchmark's extra_info (the ok records are those dicts), so --benchmark-json and
    # --benchmark-autosave carry them.
    if runner.PYTEST_RECORDS:
        results.add_ratios(runner.PYTEST_RECORDS)
    yield


def pytest_terminal_summary(terminalreporter):
    recs = runner.PYTEST_RECORDS
    if not recs:
        return
    tr = terminalreporter
    tr.section("relative-attention benchmark tables (markdown)")
    tr.write_line(results.format_markdown(recs))
    if any(r["kind"] == "cpu_attention" for r in recs):
        from benchmarks import cpu_suite

        tr.section("fused CPU kernel: the target ratios (markdown)")
        tr.write_line(cpu_suite.summary(recs))
    if not any(r["device"] == "cuda" for r in recs):
        tr.write_line("No CUDA device: CPU smoke subset only; these times are not GPU numbers.")
