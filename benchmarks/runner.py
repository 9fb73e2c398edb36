"""Run one (case, provider): build the inputs and the step, measure the peak memory, time it,
turn an out-of-memory into a record, and free the memory so the matrix goes on.

Timing is left to the tools made for it: ``report.py`` uses :func:`measure`
(``triton.testing.do_bench`` on CUDA, ``torch.utils.benchmark.Timer`` on CPU), the
pytest-benchmark suite its ``benchmark.pedantic`` on :func:`synced` steps.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import warnings
from typing import Callable, Dict, List, Optional

import torch

from . import providers as P
from .shapes import FWD, FWD_BWD, Case

# Records of the pytest run (ok ones are the benchmark's extra_info dicts themselves), read by
# benchmarks/conftest.py at session end to add the ratios and print the tables.
PYTEST_RECORDS: List[dict] = []


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # Allocation failures raised as plain RuntimeError by some paths (CPU allocator, cuBLAS
    # workspace, compiled kernels).
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg
                                             or "can't allocate memory" in msg)


def provider_for(case: Case, name: str) -> P.Provider:
    table = P.PROVIDERS_BY_KIND[case.kind]
    if name not in table:
        raise KeyError(f"no provider {name!r} for kind {case.kind!r}; have {list(table)}")
    return table[name]


def skip_reason(case: Case, name: str) -> Optional[str]:
    provider = provider_for(case, name)
    if provider.modes and case.mode not in provider.modes:
        return f"timed in {', '.join(provider.modes)} only"
    reason = P.skip_reason(provider, case.device)
    if reason is None and case.kind == "cpu_attention":
        from .cpu_suite import memory_skip_reason

        reason = memory_skip_reason(case, name)
    return reason


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]):
    """``torch.set_num_threads(n)`` inside the block (nothing when ``n`` is None), restored
    after."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_inputs(case: Case, name: str, seed: int = 0):
    """Inputs for (case, provider). Attention inputs do not depend on the provider (the report
    builds them once per case and shares them); module inputs carry the provider's module."""
    grad = case.mode == FWD_BWD
    if case.kind in ("attention", "cpu_attention"):
        return P.make_attn_inputs(case.shape, case.dtype, case.device, requires_grad=grad,
                                  seed=seed)
    if case.kind == "conformer_module":
        return P.make_module_inputs(case.shape, case.dtype, case.device,
                                    P.MODULE_BACKEND[name], requires_grad=grad, seed=seed,
                                    family=P.MODULE_FAMILY[name])
    if case.kind == "update_mems":
        return P.make_mems_inputs(case.shape, case.dtype, case.device, seed=seed)
    raise ValueError(f"unknown kind {case.kind!r}")


def make_step(case: Case, name: str, inputs) -> Callable[[], None]:
    """The timed call: one forward (or forward + backward), asynchronous on CUDA (the timers
    synchronise). Backward uses ``torch.autograd.grad`` so nothing accumulates between calls."""
    fn = provider_for(case, name).fn
    if case.kind == "update_mems" or case.mode == FWD:
        def step():
            with torch.no_grad():
                fn(inputs)
        return step
    if case.mode != FWD_BWD:
        raise ValueError(f"unknown mode {case.mode!r}")
    if case.kind in ("attention", "cpu_attention"):
        grad_in = inputs.tensors()
    else:
        grad_in = inputs.grad_inputs()
    holder: Dict[str, torch.Tensor] = {}

    def step():
        out = fn(inputs)
        if "g" not in holder:  # fixed upstream gradient, made once
            g = torch.Generator(device=out.device).manual_seed(7)
            holder["g"] = torch.randn(out.shape, generator=g, device=out.device,
                                      dtype=torch.float32).to(out.dtype)
        torch.autograd.grad(out, grad_in, holder["g"], allow_unused=True)
    return step


def synced(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` followed by a device synchronisation (for wall-clock timers)."""
    if device.type != "cuda":
        return step

    def run():
        step()
        sync(device)
    return run


def peak_memory(step: Callable[[], None], device: torch.device):
    """Run ``step`` once; return (peak bytes allocated, bytes allocated before):
    ``torch.cuda.max_memory_allocated`` after a reset. On CPU it returns (None, None) without
    calling ``step`` (peak RSS needs a fresh process: ``benchmarks/cpu_memory.py``)."""
    if device.type != "cuda":
        return None, None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    synced(step, device)()
    return torch.cuda.max_memory_allocated(device), base


def measure(step: Callable[[], None], device: torch.device, min_run_time_s: float = 0.25
            ) -> List[float]:
    """Seconds per call: ``triton.testing.do_bench`` on CUDA (CUDA events, L2 flushed between
    calls, about ``min_run_time_s`` of calls) and ``torch.utils.benchmark.Timer`` on CPU
    (``blocked_autorange``: the per-call mean of each block of calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        ms = do_bench(step, warmup=max(1, int(min_run_time_s * 100)),
                      rep=max(1, int(min_run_time_s * 1e3)), return_mode="all")
        return [t / 1e3 for t in ms]
    from torch.utils.benchmark import Timer
    return list(Timer(stmt="step()", globals={"step": step})
                .blocked_autorange(min_run_time=min_run_time_s).times)


def base_record(case: Case, name: str) -> dict:
    shape = case.shape
    rec = dict(kind=case.kind, key=case.key, group=case.group, device=case.device,
               label=shape.label, dtype=case.dtype, mode=case.mode, provider=name,
               seqlen=shape.seqlen, series=series_of(case), status="ok", reason="",
               time_s=None, reps=0, flops=case.flops(name), tflops=None, bandwidth_gbs=None,
               peak_bytes=None, work_bytes=None, note="")
    return rec


def series_of(case: Case) -> str:
    """Plot series: the case without its sequence length."""
    s = case.shape
    if case.kind == "cpu_attention":
        extra = "causal" if s.causal else "full"
        return f"{s.group} B{s.B} H{s.H} D{s.D} {extra} {s.threads}thr {case.dtype} {case.mode}"
    if case.kind == "attention":
        extra = ("causal" if s.causal else "full") + (" pad" if s.key_padding else "")
        mem = f" mem/q={s.mem // s.Lq}" if s.mem and s.group != "txl_eval" else ""
        return f"{s.group} B{s.B} H{s.H} D{s.D} {extra}{mem} {case.dtype} {case.mode}"
    if case.kind == "conformer_module":
        return f"{s.group} B{s.B} H{s.H} D{s.D} {case.dtype} {case.mode}"
    return f"{s.group} {case.dtype}"


def finish_record(rec: dict, case: Case, times: List[float]) -> dict:
    rec["reps"] = len(times)
    if not times:
        return rec
    t = statistics.median(times)
    rec["time_s"] = t
    rec["time_min_s"] = min(times)
    if rec["flops"]:
        rec["tflops"] = rec["flops"] / t / 1e12
    if case.kind == "update_mems":
        rec["bandwidth_gbs"] = case.shape.moved_bytes(P.DTYPES[case.dtype].itemsize) / t / 1e9
    return rec


def run_case(case: Case, name: str,
             timer: Callable[[Callable[[], None], torch.device], List[float]],
             inputs=None, raise_errors: bool = False, warmup: int = 1) -> dict:
    """Run (case, provider) and return its record.

    ``warmup`` untimed calls come first (compilation, autotuning, extension build). A shape with
    a ``threads`` field (``shapes.CpuAttnShape``) runs at that intra-op thread count.

    ``timer(step, device)`` returns the list of per-call seconds (e.g. :func:`measure`). Status:
    ``ok``; ``skipped`` (not timed here, ``reason`` says why, or a missing piece that could not
    be imported); ``oom`` (out of memory: memory freed, the matrix goes on); ``error`` (any
    other exception, only when ``raise_errors`` is False).
    """
    rec = base_record(case, name)
    reason = skip_reason(case, name)
    if reason:
        rec.update(status="skipped", reason=reason)
        return rec
    device = torch.device(case.device)
    failure = None
    try:
        with intra_op_threads(getattr(case.shape, "threads", None)):
            _run_timed(case, name, timer, inputs, rec, device, warmup)
    except ImportError as exc:
        failure = ("skipped", f"a piece is missing: {type(exc).__name__}: {exc}"[:400])
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised on request
        if is_oom(exc):
            failure = ("oom", f"out of memory: {str(exc).splitlines()[0][:300]}")
        elif raise_errors:
            raise
        else:
            failure = ("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                       if str(exc) else type(exc).__name__)
    if failure is not None:
        rec.update(status=failure[0], reason=failure[1], time_s=None, tflops=None)
    # Drop every reference to the inputs and intermediates before the next provider runs.
    del inputs
    free_memory(device)
    return rec


def _run_timed(case: Case, name: str, timer, inputs, rec: dict, device: torch.device,
               warmup: int) -> None:
    """The body of :func:`run_case`: inputs, warm-up, peak memory, timing, into ``rec``."""
    if inputs is None:
        inputs = make_inputs(case, name)
    step = make_step(case, name, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup):
            synced(step, device)()
    notes = sorted({str(w.message).splitlines()[0][:160] for w in caught
                    if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
    if notes:
        rec["note"] = "; ".join(notes)[:400]
    peak, base = peak_memory(step, device)
    rec["peak_bytes"] = peak
    rec["work_bytes"] = None if peak is None else peak - base
    times = timer(step, device)
    finish_record(rec, case, times)


def timer_for(min_run_time_s: float):
    """The report's timer: :func:`measure` for about ``min_run_time_s`` per (case, provider)."""
    def timer(step, device):
        return measure(step, device, min_run_time_s)
    return timer
