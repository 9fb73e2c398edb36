"""The one test body shared by the pytest-benchmark files."""
import pytest
import torch

from benchmarks import runner, shapes


def run(benchmark, case, provider):
    cpu_kernel = case.kind == "cpu_attention"  # CPU cases by design: run with or without a GPU
    if case.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPU shape: needs a CUDA device (the CPU subset runs instead)")
    if case.device == "cpu" and torch.cuda.is_available() and not cpu_kernel:
        pytest.skip("CPU smoke shape: a CUDA device is present, the full shapes run instead")
    reason = runner.skip_reason(case, provider)
    if reason:
        if cpu_kernel:  # its summary says which baseline did not fit, and why
            runner.PYTEST_RECORDS.append(dict(runner.base_record(case, provider),
                                              status="skipped", reason=reason))
        pytest.skip(reason)
    benchmark.group = f"{case.kind} | {case.group} {case.shape.label} | {case.dtype} {case.mode}"
    if cpu_kernel:
        rounds, warmup = shapes.rounds_for(case.shape, provider), case.shape.warmup
    else:
        rounds, warmup = (20 if case.device == "cuda" else 3), 1

    def timer(step, device):  # pytest-benchmark times; CUDA steps are synchronised for it
        benchmark.pedantic(runner.synced(step, device), rounds=rounds, iterations=1,
                           warmup_rounds=1 if device.type == "cuda" else 0)
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        return list(stats.data) if stats is not None else []

    rec = runner.run_case(case, provider, timer, raise_errors=True, warmup=warmup)
    if rec["status"] == "ok":
        benchmark.extra_info.update(rec)
        runner.PYTEST_RECORDS.append(benchmark.extra_info)
        return
    runner.PYTEST_RECORDS.append(rec)
    if rec["status"] == "oom":
        pytest.skip(f"OOM: {rec['reason']}")
    pytest.skip(rec["reason"])
