"""The CPU kernel's target ratios, measured interleaved: for each case the providers run in
turn, one call each per round (``cpu_fused``, then each baseline), so a load that comes and goes
on a shared machine hits them alike; the ratios are those of the medians. Prints the machine,
``uptime`` before and after each thread count, and the target table of
``benchmarks/cpu_suite.py`` (the same rows as ``TXL_BENCH_CPU_KERNEL=issue pytest
benchmarks/test_bench_cpu_kernel.py --benchmark-only``, which times each provider in a block
of its own).

    python benchmarks/cpu_ratios.py                      # the target shapes (T up to 16,384)
    python benchmarks/cpu_ratios.py --max-t 4096 --threads 1 --clock cpu
    python benchmarks/cpu_ratios.py --threads 1 --modes fwd --processes 5
    python benchmarks/cpu_ratios.py --dtypes bf16 --max-t 4096
    python benchmarks/cpu_ratios.py --min-t 16384 --size full   # T 16,384 alone, every mode

Each case runs in fp32 and, where the CPU has native bf16 (AVX512-BF16 or AMX), in bf16 too,
against the baselines in the same dtype (``--dtypes`` chooses).

``--processes N`` runs the whole selection N times, each in a fresh process, one after
another, and judges each target by the median of the N ratios: on a virtual machine the speed
of one process (where its memory landed) can differ from the next by more than the rounds
inside one process differ, and interleaving the providers does not cancel that.

``--clock cpu`` times one-thread cases by the calling thread's CPU time (``time.thread_time``:
at one thread every provider computes on that thread), which a machine loaded by other
processes disturbs far less than the wall clock; the default, ``wall``, is what an idle machine
should be measured with (and the only meaningful clock for several threads).

A dense baseline whose tensors would not fit in memory is skipped with its estimated bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import cpu_suite, runner, shapes  # noqa: E402


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime: n/a"


def run_case(case: shapes.Case, size: str, clock=time.perf_counter) -> List[dict]:
    """Records (``runner.base_record`` with the median time) of every provider on ``case``,
    timed round-robin; a provider with fewer rounds (``shapes.rounds_for``) drops out when its
    rounds are done."""
    names = shapes.PROVIDER_ORDER["cpu_attention"]
    records: Dict[str, dict] = {n: runner.base_record(case, n) for n in names}
    steps = {}
    with runner.intra_op_threads(case.shape.threads):
        inputs = runner.make_inputs(case, cpu_suite.OURS)
        for n in names:
            reason = runner.skip_reason(case, n)
            if reason:
                records[n].update(status="skipped", reason=reason)
                continue
            steps[n] = runner.make_step(case, n, inputs)
            for _ in range(case.shape.warmup):
                steps[n]()
        times: Dict[str, List[float]] = {n: [] for n in steps}
        rounds = {n: shapes.rounds_for(case.shape, n, size) for n in steps}
        for r in range(max(rounds.values(), default=0)):
            for n, step in steps.items():
                if r < rounds[n]:
                    t0 = clock()
                    step()
                    times[n].append(clock() - t0)
    for n, ts in times.items():
        runner.finish_record(records[n], case, ts)
    del inputs, steps
    runner.free_memory(torch.device("cpu"))
    return list(records.values())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="issue", choices=shapes.CPU_KERNEL_SIZES,
                    help="the preset of benchmarks/shapes.py (default: issue)")
    ap.add_argument("--threads", type=int, nargs="*",
                    help="thread counts to run (default: 1 and all cores)")
    ap.add_argument("--max-t", type=int, default=None,
                    help="leave out Conformer lengths above this")
    ap.add_argument("--min-t", type=int, default=None,
                    help="leave out Conformer lengths below this, and the Transformer-XL shapes")
    ap.add_argument("--modes", nargs="*", default=list(shapes.MODES), choices=shapes.MODES)
    ap.add_argument("--dtypes", nargs="*", choices=("fp32", "bf16"),
                    help="default: fp32, and bf16 where the CPU has native bf16 "
                         "(benchmarks/cpu_suite.py's bf16_wanted)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="wall: time.perf_counter; cpu: the thread's CPU time (one thread only)")
    ap.add_argument("--processes", type=int, default=1,
                    help="run the selection in N fresh processes, one after another, and judge "
                         "each target by the median of their ratios (default 1: this process)")
    ap.add_argument("--emit-json", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != [1]:
        ap.error("--clock cpu needs --threads 1 (it counts the calling thread's CPU time)")
    if args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    if args.processes > 1:
        return _in_processes(child_argv(argv if argv is not None else sys.argv[1:]),
                             args.processes)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    from benchmarks.providers import cpu_fused_unavailable

    why = cpu_fused_unavailable()
    if why:
        print(f"cpu_fused cannot run: {why}", file=sys.stderr)
        return 1
    cases = [c for c in shapes.cpu_kernel_cases(args.size, args.dtypes or cpu_suite.cpu_dtypes())
             if (args.threads is None or c.shape.threads in args.threads)
             and c.mode in args.modes
             and not (args.max_t and c.shape.group == "cpu_conformer"
                      and c.shape.Lq > args.max_t)
             and not (args.min_t and (c.shape.group != "cpu_conformer"
                                      or c.shape.Lq < args.min_t))]
    records: List[dict] = []
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, clock: {args.clock}",
          flush=True)
    for threads in sorted({c.shape.threads for c in cases}):
        print(f"# {threads} thread(s), before: {uptime()}", flush=True)
        for case in (c for c in cases if c.shape.threads == threads):
            recs = run_case(case, args.size, clock)
            records += recs
            line = ", ".join(f"{r['provider']} {r['time_s'] * 1e3:.1f} ms" if r["time_s"]
                             else f"{r['provider']} {r['status']}" for r in recs)
            print(f"#   {case.shape.label} {case.mode}: {line}", flush=True)
        print(f"# {threads} thread(s), after: {uptime()}", flush=True)
    if args.emit_json:
        print(json.dumps({"records": records}))
        return 0
    print()
    print(cpu_suite.summary(records))
    return 0


def child_argv(argv: List[str]) -> List[str]:
    """The arguments of each child of ``--processes``: the same selection, one process each
    (the last ``--processes`` wins, whatever spelling came before), records out as JSON."""
    return list(argv) + ["--processes", "1", "--emit-json"]


def _in_processes(child: List[str], n: int) -> int:
    """``main`` with the arguments ``child`` in ``n`` fresh processes in turn (each printing its
    records as JSON), then the targets by the median over the processes."""
    runs: List[List[dict]] = []
    for i in range(n):
        print(f"# process {i + 1} of {n}, start: {uptime()}", flush=True)
        out, why = cpu_suite.run_json_child(__file__, child, timeout_s=4 * 3600)
        if out is None:
            print(f"# process {i + 1} gave no result: {why}", file=sys.stderr)
            return 1
        runs.append(out["records"])
        for row in cpu_suite.target_rows(out["records"]):
            print(f"#   {row[0]} {row[2]} / {row[4]}: {row[6] or row[8][:80]}", flush=True)
    print()
    print(cpu_suite.median_summary(runs))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
