#!/usr/bin/env python
"""ONNX Runtime on the exported Conformer encoder: the Hugging Face Parakeet encoder
(transformers 5.x, random weights) exported as NeMo exports its encoders
(``torch.onnx.export(dynamo=False, opset_version=17)``, dynamic batch and time axes), (a) the
original and (b) after ``txl_kernels.swap_rel_pos_attention``, both run in ONNX Runtime on the
CPU. The target: (b) within 10% of (a) at every length, so swapping never costs a deployer
speed in their runtime.

    python benchmarks/onnx_encoder.py                      # 30 s, 1, 2, 5 min; 1 and 2 threads
    python benchmarks/onnx_encoder.py --layers 24          # the full-depth encoder
    python benchmarks/onnx_encoder.py --quick              # smoke run: tiny encoder, seconds

The encoder is ``ParakeetEncoder`` as in ``benchmarks/long_audio.py`` (hidden 1024, 8 heads,
feed-forward 4096, ``--layers`` blocks, default 2; 12.5 encoder frames per second of audio, so
5 minutes = 30,000 mel frames in, 3,750 frames through the attention). One process exports
both graphs (from a 4 s input; the graphs have no fixed length) and checks each in ONNX
Runtime against its eager module at the shortest benchmarked length, and the two eager modules
against each other. Then each (length, threads, variant) point runs in a fresh process that
imports only onnxruntime and numpy: an ``InferenceSession`` (CPUExecutionProvider,
``intra_op_num_threads`` = threads, sequential execution, default graph optimisations), one
warm-up run on a short input, then the timed run. The process reads its RSS before the timed
run (the baseline), resets the peak RSS (``/proc/self/clear_refs``) and reports the run's wall
time, its CPU time (the process's, all threads: the steadier figure on a shared machine, where
the wall time also counts other programs' turns; the target is on the wall time), the peak RSS
and the extra above the baseline. Repeats are interleaved (every point once,
then again; the order of the two variants alternates) and the table gives medians. Both
variants get the same input; their outputs are compared at every length.

``--mask`` adds the encoder's ``attention_mask`` input (all frames valid), as NeMo's exported
encoders take the lengths.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_suite, long_audio  # noqa: E402  (torch-free)

VARIANTS = ("original", "swapped")
GiB = 2 ** 30
TARGET = 1.10            # swapped time / original time, at every point
EXPORT_SECONDS = 4.0     # the dummy input's length at export time
WARMUP_MEL = 16 * long_audio.SUBSAMPLING
AGREE_TOL = 1e-4         # largest difference / mean output size, ORT vs eager and (a) vs (b)
QUICK = dict(minutes=[0.05, 0.1], threads=[1], repeats=1, layers=1, hidden=64, heads=2)


def mel_frames(minutes: float) -> int:
    return long_audio.encoder_frames(minutes) * long_audio.SUBSAMPLING


def features(mel: int, n_mels: int, seed: int):
    """The input features of one length (numpy fp32 [1, mel, n_mels]); the same for both
    variants and for the eager check."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal((1, mel, n_mels), dtype=np.float32)


def feeds(x, mask: bool) -> dict:
    """The ONNX graph's inputs for features ``x``."""
    import numpy as np

    out = {"input_features": x}
    if mask:
        out["attention_mask"] = np.ones(x.shape[:2], dtype=np.int64)
    return out


def difference(a, b) -> float:
    """Largest difference of two outputs relative to the first's mean size."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / max(np.abs(a).mean(), 1e-30))


def session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------------------------
# The export process


def last_hidden(encoder):
    """``encoder(input_features[, attention_mask]).last_hidden_state`` as an nn.Module."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features, attention_mask=None):
            return self.encoder(input_features, attention_mask=attention_mask).last_hidden_state

    return LastHidden().eval()


def graph_summary(path: str) -> dict:
    """Node count and op-type histogram of an ONNX file."""
    import collections

    import onnx

    model = onnx.load(path, load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return dict(nodes=sum(ops.values()), ops=dict(ops.most_common()),
                bytes=os.path.getsize(path))


def encoder(variant: str, args):
    """(encoder, config): the encoder of ``long_audio.build_encoder(args)``, its attention
    swapped (``swap_rel_pos_attention(backend=args.backend)``) for ``variant`` "swapped"."""
    enc, cfg = long_audio.build_encoder(args)
    if variant == "swapped":
        from txl_kernels import swap_rel_pos_attention

        n = swap_rel_pos_attention(enc, backend=args.backend)
        if n != args.layers:
            raise RuntimeError(f"swap_rel_pos_attention replaced {n} modules, expected "
                               f"{args.layers}")
    return enc, cfg


def export_child(args) -> dict:
    """Export both variants into ``args.workdir``; check each in ORT against eager."""
    import numpy as np
    import torch

    torch.set_num_threads(max(args.threads))
    rec = dict(check_mel_frames=mel_frames(min(args.minutes)),
               export_mel_frames=mel_frames(EXPORT_SECONDS / 60))
    eager = {variant: export_variant(variant, args, rec) for variant in VARIANTS}
    rec["eager_swapped_vs_original"] = difference(eager["original"], eager["swapped"])
    rec["check_frames"] = int(np.asarray(eager["original"]).shape[1])
    return rec


def export_variant(variant: str, args, rec: dict):
    """Export ``variant`` to ``args.workdir``/<variant>.onnx and run it in ORT against its
    eager module at ``rec["check_mel_frames"]``; the export time, graph summary, ORT vs eager
    difference and ``n_mels`` go into ``rec``. Returns the eager output (numpy)."""
    import torch

    enc, cfg = encoder(variant, args)
    model = last_hidden(enc)
    names = ["input_features"] + (["attention_mask"] if args.mask else [])
    x = torch.from_numpy(features(rec["export_mel_frames"], cfg.num_mel_bins, 1))
    inputs = (x, torch.ones(x.shape[:2], dtype=torch.int64)) if args.mask else (x,)
    dyn = {n: {0: "batch", 1: "mel_frames"} for n in names}
    dyn["last_hidden_state"] = {0: "batch", 1: "frames"}
    path = str(Path(args.workdir) / f"{variant}.onnx")
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, inputs, path, dynamo=False, opset_version=17,
                          input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=dyn)
    rec[f"{variant}_export_s"] = time.perf_counter() - t0
    rec[f"{variant}_graph"] = graph_summary(path)
    xc = features(rec["check_mel_frames"], cfg.num_mel_bins, 2)
    with torch.no_grad():
        args_c = (torch.from_numpy(xc),)
        if args.mask:
            args_c += (torch.ones(xc.shape[:2], dtype=torch.int64),)
        eager = model(*args_c).numpy()
    got = session(path, max(args.threads)).run(None, feeds(xc, args.mask))[0]
    rec[f"{variant}_ort_vs_eager"] = difference(eager, got)
    rec["n_mels"] = cfg.num_mel_bins
    return eager


# ---------------------------------------------------------------------------------------------
# One timed point (a fresh process: onnxruntime and numpy only)


def point_features(minutes: float, n_mels: int):
    """The input of the timed run at ``minutes`` (the same in every process and runtime)."""
    return features(mel_frames(minutes), n_mels, int(minutes * 6000) + 7)


def timed(fn):
    """``fn()`` once, measured -> (its result, dict of seconds, cpu_seconds, peak_bytes,
    extra_bytes, base_bytes): the RSS before the call is the baseline; the peak RSS is reset
    first (``/proc/self/clear_refs``) and read after."""
    import gc

    gc.collect()
    base_kb = cpu_suite.status_kb("VmRSS")
    if not cpu_suite.reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak_kb = cpu_suite.status_kb("VmHWM")
    return out, dict(seconds=seconds, cpu_seconds=cpu_seconds, peak_bytes=peak_kb * 1024,
                     extra_bytes=max(0, peak_kb - base_kb) * 1024, base_bytes=base_kb * 1024)


def run_child(variant: str, minutes: float, threads: int, args) -> dict:
    import numpy as np

    path = str(Path(args.workdir) / f"{variant}.onnx")
    sess = session(path, threads)
    sess.run(None, feeds(features(WARMUP_MEL, args.n_mels, 3), args.mask))
    inp = feeds(point_features(minutes, args.n_mels), args.mask)
    out, measured = timed(lambda: sess.run(None, inp)[0])
    if args.save:
        np.save(args.save, out)
    return dict(variant=variant, minutes=minutes, threads=threads, T=int(out.shape[1]),
                status="ok", **measured)


def _model_argv(args) -> list:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
            str(args.heads), "--backend", args.backend, "--workdir", args.workdir,
            "--minutes", *map(str, args.minutes), "--threads", *map(str, args.threads)] \
        + (["--mask"] if args.mask else [])


def spawn(mode: list, args) -> dict:
    argv = mode + _model_argv(args)
    rec, why = cpu_suite.run_json_child(str(Path(__file__).resolve()), argv, args.timeout_s)
    return rec if rec is not None else dict(status="failed", reason=why)


# ---------------------------------------------------------------------------------------------
# Report


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "numpy"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def header_lines(script: str, argv) -> list:
    """Date, machine, versions and the command line of a benchmark run (``script``: its path
    from the repository root)."""
    return [f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            *cpu_suite.machine_lines(), f"versions: {versions()}",
            f"command: python {script} " + " ".join(argv)]


def header(args, argv) -> list:
    return header_lines("benchmarks/onnx_encoder.py", argv)


def _median(recs, key):
    vals = [r[key] for r in recs if r.get("status") == "ok"]
    return statistics.median(vals) if vals else None


def table(points: dict, agree: dict, args) -> tuple:
    """-> (markdown table, the points over the target). ``points``: (minutes, threads,
    variant) -> the repeats' records; ``agree``: minutes -> (a) vs (b) difference."""
    reps = max((len(v) for v in points.values()), default=0)
    lines = [f"ParakeetEncoder, hidden {args.hidden}, {args.heads} heads, {args.layers} "
             f"block(s), fp32, batch 1{', attention_mask input' if args.mask else ''}; "
             f"exported with torch.onnx.export(dynamo=False, opset_version=17); ONNX Runtime "
             f"CPUExecutionProvider; swapped: rel_attention(backend={args.backend!r}); median "
             f"of {reps} fresh process(es) per point.", "",
             "| audio | frames T | threads | original (s) | swapped (s) | swapped / original "
             "| CPU time ratio | original peak RSS (GiB) | swapped peak RSS (GiB) | outputs "
             "differ by | within 10% |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    over = []
    for m in sorted({k[0] for k in points}):
        for th in sorted({k[1] for k in points if k[0] == m}):
            a, b = points[(m, th, "original")], points[(m, th, "swapped")]
            ta, tb = _median(a, "seconds"), _median(b, "seconds")
            T = next((r["T"] for r in a + b if r.get("status") == "ok"),
                     long_audio.encoder_frames(m))
            if ta is None or tb is None:
                why = "; ".join(sorted({r["reason"] for r in a + b if r.get("status") != "ok"}))
                lines.append(f"| {m * 60:g} s | {T} | {th} | | | | | | | | {why} |")
                over.append((m, th, None))
                continue
            ratio = tb / ta
            ok = ratio <= TARGET
            if not ok:
                over.append((m, th, ratio))
            d = agree.get(m)
            lines.append(
                f"| {m * 60:g} s | {T} | {th} | {ta:.3f} | {tb:.3f} | {ratio:.3f} | "
                f"{_median(b, 'cpu_seconds') / _median(a, 'cpu_seconds'):.3f} | "
                f"{_median(a, 'peak_bytes') / GiB:.2f} | {_median(b, 'peak_bytes') / GiB:.2f} | "
                f"{'' if d is None else f'{d:.1e}'} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n", over


def graph_lines(exp: dict) -> list:
    out = []
    for v in VARIANTS:
        g = exp[f"{v}_graph"]
        top = ", ".join(f"{k} {n}" for k, n in list(g["ops"].items())[:12])
        out.append(f"{v}: export {exp[f'{v}_export_s']:.1f} s, {g['nodes']} nodes "
                   f"({g['bytes'] / 2 ** 20:.1f} MiB): {top}")
    return out


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=[0.5, 1, 2, 5])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="ONNX Runtime intra_op_num_threads (default 1 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2, help="Conformer blocks (default 2)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--backend", default="auto",
                    help="rel_attention backend of the swapped drop-in (default auto; an ONNX "
                         "export traces the reference path whatever the backend)")
    ap.add_argument("--mask", action="store_true",
                    help="export with the attention_mask input (all frames valid)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--workdir", default=None, help="where the .onnx files go (default: a "
                    "temporary folder, removed at the end)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per child process")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--child-export", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-run", nargs=3, metavar=("VARIANT", "MINUTES", "THREADS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--n-mels", type=int, default=80, help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    finish_args(ap, args, QUICK, ("repeats", "layers", "hidden", "heads"))
    return args


def finish_args(ap: argparse.ArgumentParser, args, quick: dict, counts) -> None:
    """``--quick``'s settings onto ``args`` (when given), then the checks: each of ``counts``
    >= 1, threads >= 1, minutes > 0 (``ap.error`` names the argument otherwise)."""
    if args.quick:
        for k, v in quick.items():
            setattr(args, k, v)
    for name in counts:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.threads) < 1 or min(args.minutes) <= 0:
        ap.error(f"--threads must be >= 1 and --minutes > 0, got {args.threads} and "
                 f"{args.minutes}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child_export:
        print(json.dumps(export_child(args)), flush=True)
        return 0
    if args.child_run:
        v, m, th = args.child_run
        print(json.dumps(run_child(v, float(m), int(th), args)), flush=True)
        return 0
    print("\n".join(header(args, argv)), flush=True)
    with workdir(args, "onnx_encoder_"):
        return _measure(args)


@contextlib.contextmanager
def workdir(args, prefix: str):
    """``args.workdir`` as given, else a fresh temporary folder (``prefix``) for the block,
    removed after it."""
    if args.workdir is not None:
        yield args.workdir
        return
    args.workdir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield args.workdir
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)


def _measure(args) -> int:
    exp = spawn(["--child-export"], args)
    if exp.get("status") == "failed":
        print(f"export failed: {exp['reason']}")
        return 1
    print(f"exported from {exp['export_mel_frames']} mel frames; checked at "
          f"{exp['check_mel_frames']} mel frames ({exp['check_frames']} frames): ONNX Runtime "
          f"vs eager {exp['original_ort_vs_eager']:.1e} (original), "
          f"{exp['swapped_ort_vs_eager']:.1e} (swapped); eager swapped vs original "
          f"{exp['eager_swapped_vs_original']:.1e} (largest difference / mean size)")
    print("\n".join(graph_lines(exp)), flush=True)
    args.n_mels = exp["n_mels"]
    points = {}
    agree = {}
    outputs = {}
    for rep in range(args.repeats):
        for i, m in enumerate(sorted(args.minutes)):
            for th in args.threads:
                order = VARIANTS if (rep + i) % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    save = None
                    if rep == 0 and th == args.threads[0]:
                        save = outputs[(m, v)] = str(Path(args.workdir) / f"out_{v}_{m:g}.npy")
                    rec = spawn(["--child-run", v, str(m), str(th)]
                                + (["--save", save] if save else []), args)
                    rec.update(variant=v, minutes=m, threads=th, repeat=rep)
                    points.setdefault((m, th, v), []).append(rec)
                    what = (f"{rec['seconds']:.3f} s, peak RSS {rec['peak_bytes'] / GiB:.2f} "
                            f"GiB" if rec["status"] == "ok" else f"failed: {rec['reason']}")
                    print(f"  repeat {rep}  {m * 60:>6g} s  {th} thread(s)  {v:<8} {what}",
                          flush=True)
                if save:
                    agree[m] = _compare_saved(outputs[(m, "original")], outputs[(m, "swapped")])
    print()
    text, over = table(points, agree, args)
    print(text)
    bad_check = [k for k in ("original_ort_vs_eager", "swapped_ort_vs_eager",
                             "eager_swapped_vs_original") if not exp[k] <= AGREE_TOL]
    bad_agree = [m for m, d in agree.items() if not d <= AGREE_TOL]
    if over:
        print("target (swapped within 10% of original at every point): NOT met at "
              + ", ".join(f"{m * 60:g} s / {th} thread(s)" + ("" if r is None else f" ({r:.2f}x)")
                          for m, th, r in over))
    else:
        print("target (swapped within 10% of original at every point): met")
    for what in bad_check + [f"outputs at {m * 60:g} s" for m in bad_agree]:
        print(f"DISAGREEMENT: {what} above {AGREE_TOL:g}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            export=exp, agree={str(m): d for m, d in agree.items()},
            points=[r for recs in points.values() for r in recs]), indent=1))
    failed = any(r.get("status") != "ok" for recs in points.values() for r in recs)
    return 1 if failed or bad_check or bad_agree else 0


def _compare_saved(path_a: str, path_b: str) -> float:
    import numpy as np

    try:
        return difference(np.load(path_a), np.load(path_b))
    except OSError:
        return float("nan")
    finally:
        for p in (path_a, path_b):
            if os.path.exists(p):
                os.remove(p)


if __name__ == "__main__":
    sys.exit(main())
