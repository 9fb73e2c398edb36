#!/usr/bin/env python
"""The whole Conformer encoder in four CPU runtimes over long audio: (a) ONNX Runtime on the
exported original encoder, (b) eager PyTorch with the txl_kernels swap, (c) the swapped
encoder under ``torch.compile`` and under AOTInductor. The encoder is the Hugging Face
Parakeet encoder (transformers 5.x, random weights) of ``benchmarks/long_audio.py``. Issue #41's
targets: (b) or (c) faster than (a) at every length from 2 minutes, at least 1.3x faster at 10
minutes if (a) still fits there, never more than 10% slower at 30 s, and running where (a) runs
out of memory.

    pip install -e '.[test,hf5]'       # test pulls the export extra: onnx, onnxruntime
    python benchmarks/encoder_runtimes.py                 # 30 s, 2, 5, 10, 20 min; 1, 2 threads
                                                          # (about 20 minutes on 2 cores)
    python benchmarks/encoder_runtimes.py --minutes 0.5 --threads 1    # one length
    python benchmarks/encoder_runtimes.py --profile 2     # where eager's time goes at 2 min
    python benchmarks/encoder_runtimes.py --quick         # smoke run: tiny encoder, ~45 s

Variants, each (variant, length, threads) point in a fresh process:

* ``ort``: the original encoder exported as ``benchmarks/onnx_encoder.py`` exports it
  (``torch.onnx.export(dynamo=False, opset_version=17)``, dynamic time axis), run by that
  script's own point (an ``InferenceSession``, CPUExecutionProvider, ``intra_op_num_threads`` =
  threads; onnxruntime and numpy only in the process).
* ``eager``: ``swap_rel_pos_attention(encoder, backend="cpu")``, eval, ``torch.inference_mode``.
* ``compile``: the eager model under ``torch.compile`` with ``torch._inductor.config.freezing =
  True`` (weights folded in as constants, so Inductor pre-packs the linear and convolution
  weights for oneDNN) and the default mode, the time axis marked dynamic
  (``torch._dynamo.mark_dynamic``) so one compile serves every length. Freezing was the
  fastest of the four ``--compile-config`` settings at 2 minutes, one thread (a few percent
  ahead of eager); max-autotune's CPU GEMM templates added nothing over oneDNN / MKL there and,
  with freezing, doubled the compile time. The compile happens on a 4 s warm-up input (below
  257 mel frames the graph's guards, from layer_norm's contiguity and conv2d's fake kernel,
  bound the length at 256 and a longer input would recompile); it is excluded from the timed
  run and reported in its own column; recompiling in the timed run is an error
  (``torch._dynamo.config.error_on_recompile``).
* ``aoti``: the swapped encoder through ``torch.export`` and
  ``torch._inductor.aoti_compile_and_package`` (freezing as above), the mel-frame axis dynamic
  as a multiple of 8 (the subsampling factor: a free axis fails export's constraint check;
  every length here is one), compiled once per thread count in the preparing process (Inductor
  writes the thread count into its OpenMP loops); each point's process calls
  ``txl_kernels.load_library()`` and loads the package (``aoti_load_package``; no eager model
  is built there). The export + compile time is in the preparation line.

One preparing process exports the original graph (from a 4 s input) and checks it in ONNX
Runtime against eager at the shortest length (at most 30 s), and builds the AOTI packages
(checked likewise against the eager swapped encoder). Each point's process builds its runtime,
runs one warm-up
on a short input (128 mel frames; 400 for ``compile``, which compiles there), then the timed
forward on the length's input (the same seeded features in every runtime). Around the timed
run it reads its RSS (baseline: interpreter, libraries, weights, input), resets the peak
(``/proc/self/clear_refs``) and reports: wall time, CPU time (the process's, all threads), peak
RSS and extra RSS (peak - baseline). Repeats are interleaved (every point once, then again; the
variants' order rotates), the tables give medians; ``--repeats`` (default 3) below 5 minutes,
``--long-repeats`` (default 1) from 5 minutes on. Memory: a watchdog in the parent polls the
machine's available memory and kills a child when less than ``--memory-reserve-gib`` (default
2) is left, recorded as "out of memory at X GiB" (its RSS then; 2 blocks on a 23.5 GiB
machine: ONNX Runtime peaks at 11.3 GiB at 10 minutes and is stopped at about 21 GiB at 20);
a variant that ran out of memory is not started at longer lengths. Each point also has a
timeout (``--timeout-s``). The default matrix takes about 20 minutes on 2 cores (per point:
ort's process about 1 s besides its run, eager's 7 s, compile's 18 s with an 11 s compile,
aoti's 5 s, plus two AOTI builds of about 25 s; ONNX Runtime alone takes about 1.5 minutes at
10 minutes, one thread, and about as long to run out of memory at 20).

Outputs: the first repeat's output of every variant (at the first thread count) is saved and
compared against ``ort`` (against ``eager`` where ``ort`` did not run): largest difference /
mean output size, at most ``onnx_encoder.AGREE_TOL``; above it the script prints DISAGREEMENT and
exits 1 (as it does when one of ours fails; ``ort`` running out of memory is a result, not a
failure).

Tables (markdown, for BENCHMARKS.md): per point, every variant's wall time, CPU time, peak and
extra RSS (GiB), ``vs ort`` (ort's wall time / the variant's: above 1 = faster than ONNX
Runtime) and the compile time; then a summary per length and thread count (the four wall
times, the best of ours and its speed-up over ort, the outputs' largest difference), then the
targets, PASS / MISS / n/a each, and "where ONNX Runtime still wins" (the points where its wall
time is below the best of ours, or its peak RSS below all of ours). ``--json PATH`` writes every
record.

``--profile MINUTES``: instead of the matrix, one fresh process runs the eager swapped encoder
once under ``torch.profiler`` (CPU; ``--threads``' first value) after a warm-up, and prints the
ops' self CPU time (top 12, share of the total), the shares by kind (linear layers, convolutions,
ours, the rest), "ours" (the txl_kernels ops: the fused CPU kernel
``txl_kernels::rel_attn_fwd``) and the swapped attention modules' inclusive time
(projections + kernel + glue, from a ``record_function`` around each module's forward).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_suite, long_audio, onnx_encoder  # noqa: E402  (torch-free)

VARIANTS = ("ort", "eager", "compile", "aoti")
OURS = ("eager", "compile", "aoti")
GiB = 2 ** 30
AGREE_TOL = onnx_encoder.AGREE_TOL
LONG_MINUTES = 5          # from this length on, --long-repeats repeats
CHECK_MINUTES = 0.5       # the preparing process's checks against eager: at most this long
# torch.compile settings tried at 2 minutes (--compile-config); "freezing" is the default
COMPILE_CONFIGS = {
    "default": dict(freezing=False, mode=None),
    "freezing": dict(freezing=True, mode=None),
    "max-autotune": dict(freezing=False, mode="max-autotune-no-cudagraphs"),
    "freezing+max-autotune": dict(freezing=True, mode="max-autotune-no-cudagraphs"),
}
# one length: every torch.compile point costs a compile (seconds even for this encoder)
QUICK = dict(minutes=[0.1], threads=[1], repeats=1, long_repeats=1, layers=1, hidden=64,
             heads=2)
PROFILE_TOP = 12
PROFILE_MODULE = "txl_kernels attention module"   # record_function label of a swapped module


def audio(minutes: float) -> str:
    """A length as the tables show it: "30 s", "2 min"."""
    return f"{minutes * 60:g} s" if minutes < 1 else f"{minutes:g} min"


def repeats_at(minutes: float, args) -> int:
    return args.repeats if minutes < LONG_MINUTES else args.long_repeats


# ---------------------------------------------------------------------------------------------
# The preparing process: ONNX export of the original, AOTI packages of the swapped encoder


def swapped_model(args):
    """(the swapped encoder as ``input_features -> last_hidden_state``, n_mels)."""
    enc, cfg = onnx_encoder.encoder("swapped", args)
    return onnx_encoder.last_hidden(enc), cfg.num_mel_bins


def aoti_path(args, threads: int) -> str:
    return str(Path(args.workdir) / f"swapped_{threads}t.pt2")


def set_inductor(config: str) -> None:
    import torch._inductor.config as inductor

    inductor.freezing = COMPILE_CONFIGS[config]["freezing"]


def build_aoti(args, threads: int, check_mel: int) -> dict:
    """Export the swapped encoder (dynamic mel-frame axis), compile it into an AOTI package for
    ``threads`` threads, load it and compare it with eager on ``check_mel`` mel frames."""
    import torch

    torch.set_num_threads(threads)
    set_inductor(args.compile_config)
    model, n_mels = swapped_model(args)
    x = torch.from_numpy(onnx_encoder.features(
        onnx_encoder.mel_frames(onnx_encoder.EXPORT_SECONDS / 60), n_mels, 1))
    t0 = time.perf_counter()
    with torch.inference_mode():
        # a free mel-frame axis fails export's constraint check (the subsampling's shapes
        # give guards like ``(2560 + 2560 * ((mel - 1) // 8)) % (1 + (mel - 1) // 8) == 0``);
        # export's own suggestion: mel frames a multiple of 8 (the subsampling factor)
        frames = torch.export.Dim("frames", min=onnx_encoder.WARMUP_MEL // 8, max=2 ** 21)
        ep = torch.export.export(model, (x,),
                                 dynamic_shapes={"input_features": {1: 8 * frames}})
        path = torch._inductor.aoti_compile_and_package(ep, package_path=aoti_path(args,
                                                                                   threads))
        seconds = time.perf_counter() - t0
        xc = torch.from_numpy(onnx_encoder.features(check_mel, n_mels, 2))
        diff = onnx_encoder.difference(model(xc).numpy(),
                                       torch._inductor.aoti_load_package(path)(xc).numpy())
    return {f"aoti_{threads}t_compile_s": seconds, f"aoti_{threads}t_vs_eager": diff,
            "aoti_n_mels": n_mels}


def prepare_child(args) -> dict:
    """Export the original for ``ort``, build the AOTI packages for ``aoti``; each checked
    against eager at the shortest length, at most ``CHECK_MINUTES`` (the original's eager
    attention is dense: 20 minutes would need ~40 GiB per block)."""
    check = min(min(args.minutes), CHECK_MINUTES)
    rec = dict(check_mel_frames=onnx_encoder.mel_frames(check),
               export_mel_frames=onnx_encoder.mel_frames(onnx_encoder.EXPORT_SECONDS / 60))
    if "ort" in args.variants:
        import torch

        torch.set_num_threads(max(args.threads))
        onnx_encoder.export_variant("original", args, rec)
    if "aoti" in args.variants:
        for th in args.threads:
            rec.update(build_aoti(args, th, rec["check_mel_frames"]))
            rec["n_mels"] = rec.pop("aoti_n_mels")
    return rec


# ---------------------------------------------------------------------------------------------
# One timed point (a fresh process)


def torch_runtime(variant: str, threads: int, args):
    """(callable features -> output, compile seconds or None, n_mels), warmed up: eager, the
    compiled model (compiled here, on the warm-up input) or the loaded AOTI package."""
    import torch

    torch.set_num_threads(threads)
    if variant == "aoti":   # the package holds its own weights: no eager model here
        import txl_kernels

        txl_kernels.load_library()   # the package calls txl_kernels::rel_attn_fwd
        model, n_mels = torch._inductor.aoti_load_package(aoti_path(args, threads)), args.n_mels
    else:
        model, n_mels = swapped_model(args)
    if variant == "compile":
        return (*compiled(model, n_mels, args), n_mels)
    model(torch.from_numpy(onnx_encoder.features(onnx_encoder.WARMUP_MEL, n_mels, 3)))
    return model, None, n_mels


def compiled(model, n_mels: int, args):
    """(``torch.compile(model)`` compiled for every length, the compile's seconds)."""
    import torch

    set_inductor(args.compile_config)
    model = torch.compile(model, mode=COMPILE_CONFIGS[args.compile_config]["mode"])
    # compiled on the export's 4 s input: below 257 mel frames the graph's guards (layer_norm's
    # contiguity, conv2d's fake kernel) bound the length at 256
    warm = torch.from_numpy(onnx_encoder.features(
        onnx_encoder.mel_frames(onnx_encoder.EXPORT_SECONDS / 60), n_mels, 3))
    torch._dynamo.mark_dynamic(warm, 1)   # one graph for every length
    t0 = time.perf_counter()
    model(warm)
    seconds = time.perf_counter() - t0
    torch._dynamo.config.error_on_recompile = True   # the timed run must not compile
    return model, seconds


def run_child(variant: str, minutes: float, threads: int, args) -> dict:
    if variant == "ort":
        rec = onnx_encoder.run_child("original", minutes, threads, args)
        return dict(rec, variant="ort")
    import numpy as np
    import torch

    with torch.inference_mode():
        model, compile_s, n_mels = torch_runtime(variant, threads, args)
        x = torch.from_numpy(onnx_encoder.point_features(minutes, n_mels))
        out, measured = onnx_encoder.timed(lambda: model(x))
    if args.save:
        np.save(args.save, out.numpy())
    return dict(variant=variant, minutes=minutes, threads=threads, T=int(out.shape[1]),
                status="ok", compile_s=compile_s, **measured)


def profile_child(minutes: float, threads: int, args) -> dict:
    """The eager swapped encoder's timed forward under torch.profiler: self CPU time per op,
    and the swapped attention modules' inclusive time (a record_function around each)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from txl_kernels.modules import ParakeetEncoderAttention

    with torch.inference_mode():
        model, _, n_mels = torch_runtime("eager", threads, args)
        for m in model.modules():
            if isinstance(m, ParakeetEncoderAttention):
                _label_forward(m, record_function)
        x = torch.from_numpy(onnx_encoder.point_features(minutes, n_mels))
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x)
        seconds = time.perf_counter() - t0
    events = prof.key_averages()
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events
                  if e.key != PROFILE_MODULE), key=lambda r: -r[1])
    module_us = sum(e.cpu_time_total for e in events if e.key == PROFILE_MODULE)
    return dict(minutes=minutes, threads=threads, seconds=seconds, ops=ops,
                total_us=sum(r[1] for r in ops), module_us=module_us)


def _label_forward(module, record_function) -> None:
    """Wrap ``module``'s forward in ``record_function(PROFILE_MODULE)``."""
    forward = module.forward

    def labelled(*a, **kw):
        with record_function(PROFILE_MODULE):
            return forward(*a, **kw)

    module.forward = labelled


# ---------------------------------------------------------------------------------------------
# The parent: children, the memory watchdog, outputs compared


def _model_argv(args) -> list:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
            str(args.heads), "--backend", args.backend, "--workdir", args.workdir,
            "--minutes", *map(str, args.minutes), "--threads", *map(str, args.threads),
            "--variants", *args.variants, "--compile-config", args.compile_config] \
        + ([] if args.n_mels is None else ["--n-mels", str(args.n_mels)])


def spawn(mode: list, args) -> dict:
    """Run a child under the memory watchdog -> its record, with ``process_s`` (the child's
    whole life: imports, build, compile, warm-up, the timed run)."""
    t0 = time.perf_counter()
    rec, why = cpu_suite.run_json_child(str(Path(__file__).resolve()), mode + _model_argv(args),
                                        args.timeout_s,
                                        memory_reserve=int(args.memory_reserve_gib * GiB))
    if rec is None:
        oom = why.startswith(("out of memory", "killed by signal 9")) or "alloc" in why.lower()
        rec = dict(status="out of memory" if oom else "failed", reason=why)
    rec["process_s"] = time.perf_counter() - t0
    return rec


def compare_outputs(paths: dict) -> dict:
    """variant -> largest difference / mean size of its output against ort's (eager's where
    ort has none); the files are removed."""
    import numpy as np

    ref = "ort" if "ort" in paths else "eager"
    try:
        base = np.load(paths[ref]) if ref in paths else None
        return {} if base is None else {
            v: onnx_encoder.difference(base, np.load(p)) for v, p in paths.items() if v != ref}
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.remove(p)


def _order(rep: int, i: int, variants) -> list:
    k = (rep + i) % len(variants)
    return list(variants[k:]) + list(variants[:k])


def measure(args) -> tuple:
    """Every point, repeats interleaved -> (points: (minutes, threads, variant) -> records,
    agree: minutes -> {variant: difference vs the reference})."""
    points, agree, stopped = {}, {}, {}
    minutes = sorted(args.minutes)
    for rep in range(max(args.repeats, args.long_repeats)):
        for i, m in enumerate(minutes):
            if rep >= repeats_at(m, args):
                continue
            for th in args.threads:
                saved = {}
                for v in _order(rep, i, args.variants):
                    rec = _point(v, m, th, rep, args, stopped, saved)
                    if rec is not None:
                        points.setdefault((m, th, v), []).append(rec)
                if saved:
                    agree[m] = compare_outputs(saved)
    return points, agree


def _point(v, m, th, rep, args, stopped, saved):
    """One point's record (None: a repeat of a point that did not run)."""
    if (v, th) in stopped:
        if rep > 0:
            return None
        rec = dict(status="not run", reason=f"{stopped[(v, th)]} at a shorter length")
    else:
        save = None
        if rep == 0 and th == args.threads[0]:
            save = saved[v] = str(Path(args.workdir) / f"out_{v}_{m:g}.npy")
        rec = spawn(["--child-run", v, str(m), str(th)] + (["--save", save] if save else []),
                    args)
        if rec["status"] != "ok":
            stopped[(v, th)] = rec["status"]
            saved.pop(v, None)
    rec.update(variant=v, minutes=m, threads=th, repeat=rep)
    rec.setdefault("T", long_audio.encoder_frames(m))
    print(f"  repeat {rep}  {audio(m):>6}  {th} thread(s)  {v:<8} {_what(rec)}", flush=True)
    return rec


def _why(rec: dict) -> str:
    """A point that did not run: its status and the reason (once where they start alike)."""
    reason = rec.get("reason", "")
    return reason if reason.startswith(rec["status"]) else f"{rec['status']}: {reason}"


def _what(rec: dict) -> str:
    if rec["status"] != "ok":
        return _why(rec)
    extra = "" if rec.get("compile_s") is None else f", compile {rec['compile_s']:.1f} s"
    return (f"{rec['seconds']:.3f} s (CPU {rec['cpu_seconds']:.2f} s), peak RSS "
            f"{rec['peak_bytes'] / GiB:.2f} GiB{extra}")


# ---------------------------------------------------------------------------------------------
# Tables and targets


def _median(recs, key):
    vals = [r[key] for r in recs if r.get("status") == "ok" and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def best_ours(points: dict, m: float, th: int):
    """(variant, median wall time) of the fastest of ours at (m, th), or None."""
    times = [(v, _median(points.get((m, th, v), []), "seconds")) for v in OURS]
    times = [(v, t) for v, t in times if t is not None]
    return min(times, key=lambda vt: vt[1]) if times else None


def point_table(points: dict, args) -> str:
    reps = max((len(v) for v in points.values()), default=0)
    lines = [f"ParakeetEncoder, hidden {args.hidden}, {args.heads} heads, {args.layers} "
             f"block(s), fp32, batch 1; ort: the original exported with torch.onnx.export("
             f"dynamo=False, opset_version=17) in ONNX Runtime (CPUExecutionProvider); eager / "
             f"compile / aoti: swap_rel_pos_attention(backend={args.backend!r}); torch.compile "
             f"and AOTI with {args.compile_config}; median of up to {reps} fresh process(es) "
             f"per point.", "",
             "| audio | frames T | threads | variant | wall (s) | CPU (s) | peak RSS (GiB) | "
             "extra RSS (GiB) | vs ort | compile (s) | note |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for (m, th, v), recs in sorted(points.items(), key=lambda kv: (
            kv[0][0], kv[0][1], VARIANTS.index(kv[0][2]))):
        T = recs[0]["T"]
        t = _median(recs, "seconds")
        if t is None:
            why = "; ".join(sorted({_why(r) for r in recs}))
            lines.append(f"| {audio(m)} | {T} | {th} | {v} | | | | | | | {why} |")
            continue
        ta = _median(points.get((m, th, "ort"), []), "seconds")
        lines.append(
            f"| {audio(m)} | {T} | {th} | {v} | {t:.3f} | {_median(recs, 'cpu_seconds'):.3f} "
            f"| {_median(recs, 'peak_bytes') / GiB:.2f} | {_median(recs, 'extra_bytes') / GiB:.2f}"
            f" | {_fmt(None if ta is None else ta / t, '.2f')} | "
            f"{_fmt(_median(recs, 'compile_s'), '.1f')} | |")
    return "\n".join(lines) + "\n"


def summary_table(points: dict, agree: dict, args) -> str:
    lines = ["| audio | threads | ort (s) | eager (s) | compile (s) | aoti (s) | best of ours | "
             "ort / best | outputs differ by (vs ort; vs eager without ort) |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for m in sorted({k[0] for k in points}):
        for th in sorted({k[1] for k in points if k[0] == m}):
            cells = []
            for v in VARIANTS:
                recs = points.get((m, th, v), [])
                t = _median(recs, "seconds")
                cells.append(_fmt(t, ".3f") if t is not None else
                             (recs[0]["status"] if recs else "-"))
            best = best_ours(points, m, th)
            ta = _median(points.get((m, th, "ort"), []), "seconds")
            d = agree.get(m, {})
            lines.append(f"| {audio(m)} | {th} | {' | '.join(cells)} | "
                         f"{best[0] if best else ''} | "
                         f"{_fmt(ta / best[1] if best and ta else None, '.2f')} | "
                         f"{_fmt(max(d.values()) if d else None, '.1e')} |")
    return "\n".join(lines) + "\n"


def _ort_oom(points: dict, m: float, th: int) -> bool:
    recs = points.get((m, th, "ort"), [])
    return bool(recs) and all(r["status"] in ("out of memory", "not run") for r in recs) and \
        any("out of memory" in r["status"] + r.get("reason", "") for r in recs)


def target_checks(points: dict) -> list:
    """The issue's four targets -> [(target, verdict PASS / MISS / n/a, detail)]."""
    keys = sorted({(k[0], k[1]) for k in points})

    def ratio(m, th):
        """ort / best of ours at (m, th); None when either is missing."""
        best, ta = best_ours(points, m, th), _median(points.get((m, th, "ort"), []), "seconds")
        return None if best is None or ta is None else ta / best[1]

    def verdict(pairs, ok, what):
        """pairs: [(m, th)] to judge; ok(r): pass on the ratio r."""
        pairs = [(m, th) for m, th in pairs
                 if points.get((m, th, "ort")) and not _ort_oom(points, m, th)]
        if not pairs:
            return "n/a", f"no point {what} where (a) ran"
        rs = {(m, th): ratio(m, th) for m, th in pairs}
        good = all(r is not None and ok(r) for r in rs.values())
        return ("PASS" if good else "MISS"), ", ".join(
            f"{audio(m)} / {th} thr: " + ("missing" if r is None else f"{r:.2f}x")
            for (m, th), r in rs.items())

    out = [("(b) or (c) faster than (a) at every length from 2 minutes",
            *verdict([k for k in keys if k[0] >= 2], lambda r: r > 1.0, "from 2 min")),
           ("(b) or (c) at least 1.3x faster than (a) at 10 minutes, if (a) fits there",
            *verdict([k for k in keys if k[0] == 10], lambda r: r >= 1.3, "at 10 min")),
           ("(b) or (c) never more than 10% slower than (a) at 30 s",
            *verdict([k for k in keys if k[0] == 0.5], lambda r: r >= 1 / 1.1, "at 30 s"))]
    oom = [k for k in keys if _ort_oom(points, *k)]
    if not oom:
        out.append(("(b) or (c) run where (a) runs out of memory", "n/a",
                    "(a) did not run out of memory at any point measured"))
    else:
        ran = {k: best_ours(points, *k) is not None for k in oom}
        out.append(("(b) or (c) run where (a) runs out of memory",
                    "PASS" if all(ran.values()) else "MISS",
                    ", ".join(f"{audio(m)} / {th} thr: " + ("ours ran" if r else "none of ours ran")
                              for (m, th), r in ran.items())))
    return out


OP_GROUPS = ("linear layers (addmm, mm)", "convolutions", "ours (txl_kernels ops)",
             "element-wise and the rest")


def op_group(name: str) -> str:
    """The kind of a profiled op, for the profile's "by kind" line."""
    if name.startswith("txl_kernels::"):
        return OP_GROUPS[2]
    if name in ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul"):
        return OP_GROUPS[0]
    return OP_GROUPS[1] if "conv" in name else OP_GROUPS[3]


def ort_wins(points: dict) -> list:
    """Where ONNX Runtime still wins: the points where its median wall time is below the best
    of ours, or its peak RSS below that of every one of ours that ran."""
    out = []
    for m, th in sorted({(k[0], k[1]) for k in points}):
        ta = _median(points.get((m, th, "ort"), []), "seconds")
        best = best_ours(points, m, th)
        peaks = [p for p in (_median(points.get((m, th, v), []), "peak_bytes") for v in OURS)
                 if p is not None]
        pa = _median(points.get((m, th, "ort"), []), "peak_bytes")
        if ta is not None and best is not None and ta < best[1]:
            out.append(f"{audio(m)} / {th} thr: time, {ta:.3f} s vs {best[1]:.3f} s ({best[0]})")
        if pa is not None and peaks and pa < min(peaks):
            out.append(f"{audio(m)} / {th} thr: peak RSS, {pa / GiB:.2f} GiB vs "
                       f"{min(peaks) / GiB:.2f} GiB")
    return out


def profile_table(rec: dict) -> str:
    total = max(rec["total_us"], 1e-9)
    lines = [f"eager swapped encoder at {audio(rec['minutes'])} of audio, {rec['threads']} "
             f"thread(s): {rec['seconds']:.2f} s under the profiler; self CPU time "
             f"{total / 1e6:.2f} s in all", "",
             "| op | calls | self CPU (s) | share |", "|---|---:|---:|---:|"]
    for name, us, n in rec["ops"][:PROFILE_TOP]:
        lines.append(f"| {name} | {n} | {us / 1e6:.3f} | {100 * us / total:.1f}% |")
    rest = sum(us for _, us, _ in rec["ops"][PROFILE_TOP:])
    lines.append(f"| (the other {len(rec['ops']) - PROFILE_TOP} ops) | | {rest / 1e6:.3f} | "
                 f"{100 * rest / total:.1f}% |")
    ours = [(name, us) for name, us, _ in rec["ops"] if name.startswith("txl_kernels::")]
    ours_us = sum(us for _, us in ours)
    groups = {g: sum(us for name, us, _ in rec["ops"] if op_group(name) == g)
              for g in OP_GROUPS}
    lines += ["", "by kind: " + ", ".join(f"{g} {100 * us / total:.1f}%"
                                          for g, us in groups.items())]
    lines += [f"ours: {100 * ours_us / total:.1f}% of the self CPU time "
              f"({', '.join(name for name, _ in ours) or 'no txl_kernels op'}: the fused kernel); "
              f"the swapped attention modules in all (projections, kernel, glue): "
              f"{100 * rec['module_us'] / total:.1f}%"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=[0.5, 2, 5, 10, 20])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeats", type=int, default=3, help=f"below {LONG_MINUTES} min (median)")
    ap.add_argument("--long-repeats", type=int, default=1, help=f"from {LONG_MINUTES} min on")
    ap.add_argument("--layers", type=int, default=2, help="Conformer blocks (default 2)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--backend", default="cpu", help="rel_attention backend of the swap")
    ap.add_argument("--compile-config", default="freezing", choices=list(COMPILE_CONFIGS),
                    help="torch.compile / AOTI settings (default freezing)")
    ap.add_argument("--profile", type=float, default=None, metavar="MINUTES",
                    help="profile the eager swapped encoder at this length instead")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--memory-reserve-gib", type=float, default=2.0,
                    help="kill a point when the machine has less available (default 2)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per child process")
    ap.add_argument("--workdir", default=None, help="the .onnx / .pt2 files (default: a "
                    "temporary folder, removed at the end)")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--mask", action="store_true", help=argparse.SUPPRESS)   # onnx_encoder's
    ap.add_argument("--child-prepare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-run", nargs=3, metavar=("VARIANT", "MINUTES", "THREADS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--child-profile", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n-mels", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    onnx_encoder.finish_args(ap, args, QUICK,
                             ("repeats", "long_repeats", "layers", "hidden", "heads"))
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for flag, child in (("child_prepare", lambda: prepare_child(args)),
                        ("child_run", lambda: run_child(args.child_run[0],
                                                        float(args.child_run[1]),
                                                        int(args.child_run[2]), args)),
                        ("child_profile", lambda: profile_child(args.child_profile,
                                                                args.threads[0], args))):
        if getattr(args, flag) not in (None, False):
            print(json.dumps(child()), flush=True)
            return 0
    print("\n".join(onnx_encoder.header_lines("benchmarks/encoder_runtimes.py", argv)),
          flush=True)
    if args.profile is not None:
        return _profile(args)
    with onnx_encoder.workdir(args, "encoder_runtimes_"):
        return _run(args)


def _profile(args) -> int:
    args.workdir = args.workdir or tempfile.gettempdir()
    rec = spawn(["--child-profile", str(args.profile)], args)
    if rec.get("status") in ("failed", "out of memory"):
        print(f"profile failed: {rec['reason']}")
        return 1
    print(profile_table(rec))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(profile=rec), indent=1))
    return 0


def _run(args) -> int:
    t0 = time.perf_counter()
    prep = spawn(["--child-prepare"], args)
    if prep.get("status") in ("failed", "out of memory"):
        print(f"preparation failed: {prep['reason']}")
        return 1
    print(_prepare_line(prep), flush=True)
    args.n_mels = prep.get("n_mels", args.n_mels)
    points, agree = measure(args)
    print()
    print(point_table(points, args))
    print(summary_table(points, agree, args))
    checks = target_checks(points)
    print("targets (issue #41; (a) ort, (b) eager, (c) compile / aoti; ratio = ort / best of "
          "ours):")
    for target, verdict, detail in checks:
        print(f"  {verdict:<4}  {target}: {detail}")
    print(f"whole run: {(time.perf_counter() - t0) / 60:.1f} min (preparation "
          f"{prep['process_s']:.0f} s)")
    print("where ONNX Runtime still wins: "
          + ("; ".join(ort_wins(points)) or "at none of the points measured"))
    bad = [k for k, d in prep.items() if k.endswith("_vs_eager") and not d <= AGREE_TOL]
    bad += [f"{v} at {audio(m)}" for m, d in agree.items() for v, x in d.items()
            if not x <= AGREE_TOL]
    for what in bad:
        print(f"DISAGREEMENT: {what} above {AGREE_TOL:g}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            prepare=prep, agree={str(m): d for m, d in agree.items()},
            targets=[dict(target=t, verdict=v, detail=d) for t, v, d in checks],
            points=[r for recs in points.values() for r in recs]), indent=1))
    failed = [r for recs in points.values() for r in recs
              if r["status"] not in ("ok", "not run") and not (
                  r["variant"] == "ort" and r["status"] == "out of memory")]
    return 1 if failed or bad else 0


def _prepare_line(prep: dict) -> str:
    parts = []
    if "original_ort_vs_eager" in prep:
        parts.append(f"ort: exported in {prep['original_export_s']:.1f} s "
                     f"({prep['original_graph']['nodes']} nodes), ONNX Runtime vs eager "
                     f"{prep['original_ort_vs_eager']:.1e}")
    for k in sorted(k for k in prep if k.startswith("aoti_") and k.endswith("_compile_s")):
        th = k[len("aoti_"):-len("_compile_s")]
        parts.append(f"aoti ({th}): export + compile {prep[k]:.1f} s, vs eager "
                     f"{prep[f'aoti_{th}_vs_eager']:.1e}")
    return (f"prepared (checked at {prep['check_mel_frames']} mel frames, largest difference / "
            f"mean size): " + "; ".join(parts or ["nothing to prepare"]))


if __name__ == "__main__":
    sys.exit(main())
