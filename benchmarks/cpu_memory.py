#!/usr/bin/env python
"""Extra memory of one relative-attention forward (or forward + backward, ``--mode``) on the CPU,
against the sequence length.

    python benchmarks/cpu_memory.py                         # fused kernel vs reference path
    python benchmarks/cpu_memory.py --T 256 512 --backend reference   # pipeline check

Conformer shape (B 1, H 8, D 64, bidirectional, R = 2T - 1, fp32 by default). Each (provider,
T) runs in a fresh Python process, which: builds the inputs; runs the provider once on a tiny
input (libraries, thread pool and the C++ extension loaded, so they are not counted); reads
VmRSS (the baseline: the interpreter, torch and the inputs); resets the peak RSS
(``/proc/self/clear_refs``, Linux) and runs one forward under ``torch.no_grad()``; then
``extra = VmHWM - baseline``. Where the kernel cannot reset the peak, ``ru_maxrss`` of the
process is used (then the tiny warm-up call must stay below the baseline, as it does).
A second forward under ``torch.profiler`` (``profile_memory=True``) gives the allocator's view:
the peak of the running sum of the tensor allocations it records (``--no-allocator`` skips it).

A provider whose dense tensors would not fit in the memory available is not started (the
estimate of ``benchmarks/cpu_suite.py``, printed); the table then carries the estimate and, for
the ratio at the largest T, a ``c * T^2`` extrapolation from the largest T measured, both marked
as such. A child killed by the kernel (out of memory) is reported, and the run goes on.

Providers: ``cpu_fused`` (``rel_attention(backend=--backend)``, "cpu" by default), ``reference``
(``backend="reference"``), optionally ``sdpa_plain``, ``sdpa_bias``, ``nemo_eager``
(``benchmarks/providers.py``).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_suite, shapes  # noqa: E402  (torch-free)

MiB = 2 ** 20


def _shape(T: int, dtype: str, mode: str = shapes.FWD) -> shapes.Case:
    s = shapes.AttnShape("cpu_memory", 1, 8, 64, T, 0, False, False, (mode,), "cpu")
    return shapes.Case("cpu_attention", s, dtype, mode)


def _call(fn, inp, mode: str):
    """One forward (no_grad), or one forward + backward (a fixed upstream gradient)."""
    import torch

    if mode == shapes.FWD:
        with torch.no_grad():
            fn(inp)
        return
    out = fn(inp)
    g = torch.ones_like(out)
    torch.autograd.grad(out, inp.tensors(), g, allow_unused=True)


def child(provider: str, T: int, dtype: str, threads: int, allocator: bool,
          mode: str = shapes.FWD) -> dict:
    """One measurement, in this (fresh) process."""
    import gc

    import torch

    from benchmarks import providers as P

    torch.set_num_threads(threads)
    if provider == "cpu_fused":
        reason = P.cpu_fused_unavailable()
        if reason:
            return dict(provider=provider, T=T, status="skipped", reason=reason)
    fn = P.CPU_ATTN_PROVIDERS[provider].fn
    grad = mode == shapes.FWD_BWD
    _call(fn, P.make_attn_inputs(_shape(16, dtype).shape, dtype, "cpu", requires_grad=grad),
          mode)  # load everything
    inp = P.make_attn_inputs(_shape(T, dtype).shape, dtype, "cpu", requires_grad=grad)
    gc.collect()
    base_kb = cpu_suite.status_kb("VmRSS")
    exact = cpu_suite.reset_peak_rss()
    t0 = time.perf_counter()
    _call(fn, inp, mode)
    seconds = time.perf_counter() - t0
    peak_kb = (cpu_suite.status_kb("VmHWM") if exact
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    rec = dict(provider=provider, T=T, dtype=dtype, threads=threads, mode=mode, status="ok",
               base_bytes=base_kb * 1024, peak_bytes=peak_kb * 1024,
               extra_bytes=max(0, peak_kb - base_kb) * 1024, seconds=seconds,
               peak_source="VmHWM after clear_refs" if exact else "ru_maxrss",
               input_bytes=sum(t.numel() * t.element_size() for t in inp.tensors()))
    if allocator:
        rec["allocator_peak_bytes"] = _allocator_peak(fn, inp, mode)
    return rec


def _allocator_peak(fn, inp, mode: str) -> int:
    """Peak of the running sum of the allocations ``torch.profiler`` records in one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _call(fn, inp, mode)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    run = peak = 0
    for _, nbytes in events:
        run += nbytes
        peak = max(peak, run)
    return peak


def run_child(provider: str, T: int, args) -> dict:
    argv = ["--child", provider, str(T), "--dtype", args.dtype, "--threads", str(args.threads),
            "--mode", args.mode] + (["--no-allocator"] if args.no_allocator else [])
    env = {"TXL_BENCH_CPU_BACKEND": args.backend} if args.backend else None
    t0 = time.time()
    rec, why = cpu_suite.run_json_child(str(Path(__file__).resolve()), argv, args.timeout_s, env)
    if rec is not None:
        return rec
    return dict(provider=provider, T=T, status="failed", reason=why, seconds=time.time() - t0)


def fmt_mib(n) -> str:
    return "" if n is None else f"{n / MiB:,.1f}"


def table(recs, args) -> str:
    """Markdown: one row per (T, provider), then the ratio at each T and the linearity."""
    what = "forward" if args.mode == shapes.FWD else "forward + backward"
    out = [f"Extra memory of one {what} (B 1, H 8, D 64, bidirectional, {args.dtype}, "
           f"{args.threads} thread(s)); MiB above the baseline RSS (inputs included in the "
           f"baseline).", "",
           "| T | provider | extra peak RSS (MiB) | allocator peak (MiB) | extra / T (KiB) "
           "| time (s) | note |", "|---:|---|---:|---:|---:|---:|---|"]
    for r in sorted(recs, key=lambda r: (r["T"], args.providers.index(r["provider"]))):
        if r["status"] == "ok":
            out.append(f"| {r['T']} | {r['provider']} | {fmt_mib(r['extra_bytes'])} | "
                       f"{fmt_mib(r.get('allocator_peak_bytes'))} | "
                       f"{r['extra_bytes'] / r['T'] / 1024:,.1f} | {r['seconds']:.2f} | |")
        else:
            out.append(f"| {r['T']} | {r['provider']} | | | | | {r['status']}: "
                       f"{r['reason']} |")
    out.append("")
    ours = {r["T"]: r for r in recs if r["provider"] == "cpu_fused" and r["status"] == "ok"}
    ref = {r["T"]: r for r in recs if r["provider"] == "reference"}
    ok_ref = {T: r for T, r in ref.items() if r["status"] == "ok"}
    if ours and ref:
        out.append("| T | reference extra / cpu_fused extra |")
        out.append("|---:|---:|")
        for T in sorted(ours):
            r = ref.get(T)
            if r is not None and r["status"] == "ok":
                ratio = r["extra_bytes"] / max(ours[T]["extra_bytes"], 1)
                out.append(f"| {T} | {ratio:,.0f}x (measured) |")
            elif ok_ref:
                Tm = max(ok_ref)
                est = ok_ref[Tm]["extra_bytes"] * (T / Tm) ** 2
                out.append(f"| {T} | {est / max(ours[T]['extra_bytes'], 1):,.0f}x (reference "
                           f"not run; its extra extrapolated as c T^2 from T = {Tm}: "
                           f"{est / 2 ** 30:.1f} GiB) |")
        out.append("")
    if len(ours) >= 2:
        Ts = sorted(ours)
        lo, hi = ours[Ts[0]], ours[Ts[-1]]
        growth = hi["extra_bytes"] / max(lo["extra_bytes"], 1)
        out.append(f"cpu_fused: T x{Ts[-1] / Ts[0]:g} from {Ts[0]} to {Ts[-1]}, extra memory "
                   f"x{growth:.1f} (linear: x{Ts[-1] / Ts[0]:g}; quadratic: "
                   f"x{(Ts[-1] / Ts[0]) ** 2:g}).")
    return "\n".join(out) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--providers", nargs="*", default=["cpu_fused", "reference"],
                    choices=shapes.PROVIDER_ORDER["cpu_attention"])
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--mode", default=shapes.FWD, choices=shapes.MODES,
                    help="one forward (default; no_grad) or one forward + backward")
    ap.add_argument("--threads", type=int, default=shapes.all_cores(),
                    help="intra-op threads (default: every core)")
    ap.add_argument("--backend", default=None,
                    help="rel_attention backend of cpu_fused (default: cpu; 'reference' checks "
                         "the pipeline where the CPU kernel is not built)")
    ap.add_argument("--no-allocator", action="store_true",
                    help="skip the second, profiled forward (the allocator's view)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per child process")
    ap.add_argument("--json", default=None, help="also write the records here")
    ap.add_argument("--child", nargs=2, metavar=("PROVIDER", "T"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        rec = child(args.child[0], int(args.child[1]), args.dtype, args.threads,
                    not args.no_allocator, args.mode)
        print(json.dumps(rec), flush=True)
        return 0
    print("\n".join(cpu_suite.machine_lines()), flush=True)
    print(f"command: python benchmarks/cpu_memory.py {' '.join(argv or sys.argv[1:])}",
          flush=True)
    recs = []
    for T in sorted(args.T):
        for name in args.providers:
            reason = cpu_suite.memory_skip_reason(_shape(T, args.dtype, args.mode), name)
            if reason:
                rec = dict(provider=name, T=T, status="not run", reason=reason)
            else:
                rec = run_child(name, T, args)
            recs.append(rec)
            print(f"  T={T:<6} {name:<11} " + (
                f"extra {fmt_mib(rec['extra_bytes'])} MiB, allocator "
                f"{fmt_mib(rec.get('allocator_peak_bytes')) or 'n/a'} MiB, {rec['seconds']:.2f} s"
                if rec["status"] == "ok" else f"{rec['status']}: {rec['reason']}"), flush=True)
    print()
    print(table(recs, args))
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))
    return 0 if all(r["status"] in ("ok", "not run") for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
