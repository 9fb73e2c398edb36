#!/usr/bin/env python
"""One command on a GPU machine: the correctness tests, then the whole benchmark matrix.

    python benchmarks/report.py                  # one H200: tests + matrix, under 8 minutes
    python benchmarks/report.py --copy-to DIR    # also copy every written file into DIR
    python benchmarks/report.py --cpu-smoke      # end-to-end check on a machine without a GPU

Steps:
 1. ``pytest tests/ -x -q`` (tests pick CUDA automatically when it is present). A failure is
    reported in the results section and the exit status, but the matrix still runs (GPU time
    is scarce); fused numbers from a failing run are marked as such.
 2. Every case of ``benchmarks/shapes.py`` (the same definitions as the pytest-benchmark suite)
    through every provider of ``benchmarks/providers.py`` on the same inputs: one warm-up call
    (compilation, autotuning), one call measuring the peak memory, then about ``--target-s``
    seconds of calls timed by ``triton.testing.do_bench`` (GPU) or
    ``torch.utils.benchmark.Timer`` (CPU); the median is reported. Out-of-memory is recorded
    and the matrix goes on.
    Cases run in priority order (bf16 first); once ``--budget-s`` (counted from the start,
    tests included) is spent, the remaining cases are recorded as not run.
 3. Prints the markdown tables (time, TFLOP/s, peak memory, speed-up and memory ratio against
    each baseline), writes a JSON of the records, a PNG of time and memory against sequence
    length, and replaces the results section of BENCHMARKS.md (date, GPU, torch and triton
    versions, the exact command).

``--cpu-smoke`` runs the same code on the small CPU shapes, those of the plotted (first) dtype
at half, once and twice their length (so the plot has curves): the reference path and the baselines that run on CPU,
``tests/test_bench_providers.py`` as the correctness step, no fused timing (never under the
Triton interpreter), output in ``./bench-results/`` (the current folder's), BENCHMARKS.md left
alone unless ``--md`` is given. The plot then shows time only (peak memory is measured on CUDA
only). Its times are not GPU numbers and must not be published.

Exit status: 0 when the tests passed and no provider raised an error (out-of-memory is not an
error); 1 otherwise; 2 for a usage problem (e.g. no CUDA device without ``--cpu-smoke``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import results, shapes  # noqa: E402  (torch-free)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="small CPU shapes at three lengths each, no fused timing, output "
                         "in ./bench-results/")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the correctness tests")
    ap.add_argument("--tests", nargs="*", default=None,
                    help="test paths (default: tests/; with --cpu-smoke: "
                         "tests/test_bench_providers.py)")
    ap.add_argument("--tests-timeout-s", type=float, default=240.0,
                    help="kill the correctness tests after this long (default 240)")
    ap.add_argument("--budget-s", type=float, default=470.0,
                    help="total wall-clock budget, tests included (default 470: under 8 min)")
    ap.add_argument("--target-s", type=float, default=None,
                    help="timed seconds per (case, provider) (default 0.25 GPU, 0 CPU: one "
                         "block of calls)")
    ap.add_argument("--kinds", nargs="*", default=None, choices=shapes.KIND_ORDER)
    ap.add_argument("--groups", nargs="*", default=None,
                    help="only these groups (txl_train, txl_eval, conformer, long, "
                         "conformer_module, update_mems)")
    ap.add_argument("--providers", nargs="*", default=None)
    ap.add_argument("--dtypes", nargs="*", default=None, choices=("bf16", "fp16"))
    ap.add_argument("--flex-static", action="store_true",
                    help="compile FlexAttention with dynamic=False (one compile per shape; "
                         "default: automatic dynamic shapes)")
    ap.add_argument("--out-dir", default=None,
                    help="where the JSON, PNG and markdown go (default benchmarks/results; "
                         "./bench-results with --cpu-smoke)")
    ap.add_argument("--md", default=None,
                    help="markdown file whose results section is replaced (default "
                         "BENCHMARKS.md; none with --cpu-smoke)")
    ap.add_argument("--no-md", action="store_true", help="do not touch any BENCHMARKS.md")
    ap.add_argument("--copy-to", default=None,
                    help="also copy every written file (and the updated markdown) here")
    return ap.parse_args(argv)


def environment(device: str) -> dict:
    import torch

    try:
        import triton
        triton_v = triton.__version__
    except Exception as exc:  # pragma: no cover
        triton_v = f"not importable ({exc})"
    gpu = "none (CPU smoke run)"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / 2 ** 30:.0f} GiB"
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=gpu, torch=torch.__version__, triton=triton_v, cuda=str(torch.version.cuda),
        python=platform.python_version(), host_cpu=platform.processor() or platform.machine())


def run_tests(paths, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", *paths, "-x", "-q", "-p", "no:cacheprovider"]
    print(f"\n== correctness: {shlex.join(cmd[2:])} (timeout {timeout_s:.0f} s)", flush=True)
    t0 = time.time()
    # Own process group, so a timeout also ends pytest's children (compile workers).
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        print((out or "")[-3000:])
        return dict(status="timed out", line=f"`pytest {' '.join(paths)} -x -q` TIMED OUT after "
                                             f"{timeout_s:.0f} s (not validated)",
                    seconds=time.time() - t0)
    tail = [ln for ln in out.strip().splitlines() if ln.strip()]
    last = tail[-1].strip("= ") if tail else "(no output)"
    print("\n".join(tail[-25:]), flush=True)
    ok = proc.returncode == 0
    status = "passed" if ok else "FAILED"
    line = f"`pytest {' '.join(paths)} -x -q` {status}: {last}"
    if not ok:
        line += " (fused numbers below are NOT validated)"
    return dict(status=status, line=line, seconds=time.time() - t0, rc=proc.returncode)


# --cpu-smoke: each CPU shape at these multiples of its length (the CPU shapes have one length
# per plot series; three make a curve)
SMOKE_LENGTH_SCALES = (0.5, 1.0, 2.0)


def length_sweep(cases, scales=SMOKE_LENGTH_SCALES):
    """The attention and Conformer-module cases of the first dtype (the one the plot draws) at
    ``scales`` times their length (attention: the query length and the memory together, so the
    memory / query ratio and the plot series stay); the other cases once, as they are."""
    plotted = next((c.dtype for c in cases if c.kind != "update_mems"), None)
    out = []
    for case in cases:
        s = case.shape
        if case.dtype != plotted:
            out.append(case)
        elif case.kind == "attention":
            out += [dataclasses.replace(case, shape=dataclasses.replace(
                s, Lq=max(1, round(s.Lq * f)), mem=round(s.mem * f))) for f in scales]
        elif case.kind == "conformer_module":
            out += [dataclasses.replace(case, shape=dataclasses.replace(
                s, T=max(1, round(s.T * f)))) for f in scales]
        else:
            out.append(case)
    return out


def select_cases(args, device):
    cases = shapes.all_cases(device, args.dtypes)
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds]
    if args.groups:
        cases = [c for c in cases if c.group in args.groups]
    return length_sweep(cases) if args.cpu_smoke else cases


def fmt_progress(rec: dict, elapsed: float) -> str:
    if rec["status"] == "ok":
        rate = (f"{rec['tflops']:.3g} TFLOP/s" if rec.get("tflops") is not None else
                f"{rec['bandwidth_gbs']:.3g} GB/s" if rec.get("bandwidth_gbs") else "")
        what = (f"{rec['time_s'] * 1e3:.3f} ms x{rec['reps']}  {rate}  "
                f"peak {results.fmt_bytes(rec['peak_bytes'])}")
    else:
        what = f"{rec['status'].upper()}: {rec['reason'][:140]}"
    return (f"[{elapsed:6.1f}s] {rec['group']:<16} {rec['label']:<34} {rec['dtype']:<4} "
            f"{rec['mode']:<7} {rec['provider']:<14} {what}")


def run_matrix(cases, device: str, provider_filter, timer, deadline: float, t_start: float,
               log=print):
    """Every (case, provider), attention inputs shared by the providers of a case."""
    import torch

    from benchmarks import runner

    records = []
    for case in cases:
        names = [p for p in shapes.PROVIDER_ORDER[case.kind]
                 if not provider_filter or p in provider_filter]
        if not names:
            continue
        shared = None
        for name in names:
            if time.time() > deadline:
                rec = runner.base_record(case, name)
                rec.update(status="skipped", reason="not run: time budget (--budget-s) spent")
            else:
                if (case.kind == "attention" and shared is None
                        and runner.skip_reason(case, name) is None):
                    try:
                        shared = runner.make_inputs(case, name)
                    except Exception as exc:  # inputs alone out of memory: every provider
                        if not runner.is_oom(exc):
                            raise
                        shared = None
                rec = runner.run_case(case, name, timer, inputs=shared)
            records.append(rec)
            log(fmt_progress(rec, time.time() - t_start))
        del shared
        runner.free_memory(torch.device(case.device))
    return records


def lm_quant_section(device: str, small: bool, deadline: float) -> str:
    """The LM with 8-bit against full-precision memory (benchmarks/test_bench_lm.py
    ``compare_quant``): Transformer-XL base in bf16 at its evaluation shapes on the GPU, the
    small model at a quarter of them for --cpu-smoke. Skipped when the budget is spent."""
    if time.time() > deadline - 60:
        return "LM with 8-bit memory: not run (time budget spent)"
    print("\n== LM with 8-bit memory (eval and one decoded token; full vs int8 / fp8 cache)",
          flush=True)
    try:
        from benchmarks import test_bench_lm as lm
        table = lm.compare_quant(lm.SMALL if small else lm.WT103_BASE,
                                 lm.SMALL_QUANT_SHAPES if small else lm.QUANT_SHAPES,
                                 min_run_time_s=0.1 if small else 0.5, device=device)
    except Exception as exc:  # the matrix's numbers are kept either way
        return f"LM with 8-bit memory: failed ({type(exc).__name__}: {exc})"
    return "#### LM with 8-bit memory (`compare_quant`)\n\n" + table + "\n\n" + \
        lm.footprint_table()


def main(argv=None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/report.py", *(argv if argv is not None
                                                              else sys.argv[1:])])
    if not args.cpu_smoke and os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: the GPU report times the compiled fused kernel; "
              "unset it (or use --cpu-smoke).", file=sys.stderr)
        return 2

    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: the GPU report needs one. For an end-to-end check of this "
              "script without a GPU run `python benchmarks/report.py --cpu-smoke`.",
              file=sys.stderr)
        return 2
    env = environment(device)
    print(f"txl_kernels benchmark report: {env['date']}; GPU {env['gpu']}; torch {env['torch']}; "
          f"triton {env['triton']}; CUDA {env['cuda']}")
    print(f"command: {command}", flush=True)

    # 1. correctness
    if args.skip_tests:
        tests = dict(status="skipped", line="not run (--skip-tests)")
    else:
        paths = args.tests if args.tests else (
            ["tests/test_bench_providers.py"] if args.cpu_smoke else ["tests/"])
        tests = run_tests(paths, args.tests_timeout_s)
    print(f"correctness: {tests['line']}", flush=True)

    # 2. the matrix
    from benchmarks import providers, runner

    if args.flex_static:
        providers.FLEX_DYNAMIC = False

    gpu = device == "cuda"
    timer = runner.timer_for(args.target_s if args.target_s is not None else
                             (0.25 if gpu else 0.0))
    cases = select_cases(args, device)
    reserve = 15.0  # writing the tables, JSON, plot
    deadline = t_start + args.budget_s - reserve
    print(f"\n== matrix: {len(cases)} cases on {device}; budget ends in "
          f"{max(0.0, deadline - time.time()):.0f} s", flush=True)
    records = run_matrix(cases, device, set(args.providers or ()), timer, deadline, t_start)
    results.add_ratios(records)
    lm_quant = lm_quant_section(device, args.cpu_smoke, deadline)

    # 3. output
    tag = "cpu-smoke" if args.cpu_smoke else "".join(
        ch if ch.isalnum() else "-" for ch in env["gpu"].split(",")[0].lower()).strip("-")
    out_dir = Path(args.out_dir) if args.out_dir else (
        Path.cwd() / "bench-results" if args.cpu_smoke else ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out_dir / f"results-{tag}.json"
    json_path.write_text(json.dumps(dict(env=env, command=command, tests=tests,
                                         records=records), indent=1, default=str))
    written.append(json_path)
    png_path = out_dir / f"results-{tag}.png"
    try:
        where = "CPU smoke run, not GPU numbers" if args.cpu_smoke else env["gpu"]
        png = results.plot(records, str(png_path),
                           title=f"txl_kernels benchmarks, {where}, {env['date']}")
    except Exception as exc:  # the numbers matter more than the picture
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        png = None
    if png:
        written.append(png_path)

    md_path = None
    if not args.no_md:
        if args.md:
            md_path = Path(args.md)
        elif not args.cpu_smoke:
            md_path = ROOT / "BENCHMARKS.md"
    plot_rel = None
    if png:
        base = md_path.resolve().parent if md_path else out_dir.resolve()
        plot_rel = os.path.relpath(png_path.resolve(), base)
    section = results.results_section(records, env, command, tests["line"], plot_rel)
    if lm_quant:
        section = section.rstrip() + "\n\n" + lm_quant + "\n"
    if args.cpu_smoke:
        section = section.replace(
            "### Latest run:", "### CPU SMOKE RUN (not GPU numbers, do not publish):", 1)
    snippet = out_dir / f"results-{tag}.md"
    snippet.write_text(section)
    written.append(snippet)
    print("\n" + section, flush=True)
    if md_path is not None:
        text = md_path.read_text() if md_path.exists() else "# Benchmarks\n"
        md_path.write_text(results.update_section(text, section))
        written.append(md_path)
        print(f"updated the results section of {md_path}")
    if args.copy_to:
        dest = Path(args.copy_to)
        dest.mkdir(parents=True, exist_ok=True)
        for p in written:
            shutil.copy2(p, dest / p.name)
        print(f"copied {', '.join(p.name for p in written)} to {dest}")
    print("wrote: " + ", ".join(str(p) for p in written))

    errors = [r for r in records if r["status"] == "error"]
    for r in errors:
        print(f"ERROR {r['provider']} {r['group']} {r['label']} {r['dtype']} {r['mode']}: "
              f"{r['reason']}", file=sys.stderr)
    not_run = sum(r["status"] == "skipped" and "time budget" in r["reason"] for r in records)
    if not_run:
        print(f"{not_run} (case, provider) pairs not run: time budget spent", file=sys.stderr)
    print(f"total {time.time() - t_start:.0f} s")
    tests_ok = tests["status"] in ("passed", "skipped")
    return 0 if tests_ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
