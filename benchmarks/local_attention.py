#!/usr/bin/env python
"""NeMo's local attention against the txl_kernels drop-in on the CPU: a stack of NeMo
``RelPositionMultiHeadAttentionLongformer`` modules (``self_attention_model=
"rel_pos_local_attn"``; the transcription in ``tests/originals_nemo_longformer.py``) next to
the same stack swapped to ``NeMoRelPositionMultiHeadAttentionLongformer`` (``from_module``: the
same Parameter objects), over long audio.

    python benchmarks/local_attention.py                  # 10, 30, 60 min; G 0, 1; 1, 2 threads
    python benchmarks/local_attention.py --minutes 60 --repeats 2 --json out.json
    python benchmarks/local_attention.py --quick          # smoke run: tiny shapes, seconds

Shapes: Parakeet's attention (hidden 1024, 8 heads of head dim 128),
``att_context_size`` ``--window L R`` (default [128, 128]), ``--global-tokens`` G (default 0
and 1; spacing 1, shared projections), batch 1, fp32, ``--layers`` N modules (default 1)
applied in sequence with a residual (``x = x + attn(x)``). Audio -> frames: 12.5 encoder frames
per second (10 minutes = 7,500 frames, 60 minutes = 45,000). ``pos_emb`` is NeMo's
``LocalAttRelPositionalEncoding`` table (L + R + 1 rows), ``pad_mask`` all False, or the last
``--pad-frac`` of the frames padded.

Each point (variant nemo / txl, minutes, G, threads, direction) runs in a fresh process:
weights seeded (the NeMo modules are built from one seed and the txl stack wraps them), input
``x`` ``[1, T, hidden]`` seeded. ``fwd``: eval mode under ``torch.no_grad()``; ``fwdbwd``: train
mode with dropout 0, the forward and ``out.backward(g)`` with a fixed random ``g``, so the
gradients reach the input and every parameter. One warm-up call at a short length (at most
1,024 frames), then ``--repeats`` timed calls of the stack (median). Around each call the
process returns freed heap to the system (``malloc_trim``), reads its RSS (the baseline),
resets the peak (``/proc/self/clear_refs``) and reads the peak after (``VmHWM``): extra = peak
- baseline (the largest over the repeats). The same is done, in the same process and on the
same inputs, for the projections alone: the ``nn.Linear`` layers the forward runs
(``linear_q/k/v`` on x, ``linear_pos`` on the position table, ``linear_out`` on a ``[1, T,
hidden]`` tensor, ``global_q/k/v`` when separate), each layer of the stack, same direction.
Attention = module - projections, for the time and for the extra memory. The drop-in's
inference forward peaks below its projections run alone (the attention writes over the query
projection, linear_out into the key projection's buffer): its attention extra memory is then
negative in the tables and counts as 0 in the ratio.

The parent runs the variants of each (minutes, G, threads, direction) one after the other
(order alternating), checks that their outputs agree (sampled rows of the output, and of the
input's gradient for fwdbwd: largest difference <= 1e-4 of the largest |output|; a failure is
printed loudly and the exit status is 1), and prints one table per direction and a "targets at
the longest length" block: module speed-up >= 2, attention speed-up >= 3, attention extra memory
<= 1/4 of NeMo's, each PASS / MISS with its numbers. A NeMo point whose score tensors (several
``[1, H, T, 2w + 1]``, w = max(L, R)) would not fit in the available memory is not started.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_suite, long_audio  # noqa: E402  (torch-free)
from benchmarks.onnx_encoder import header_lines  # noqa: E402

VARIANTS = ("nemo", "txl")
DIRECTIONS = ("fwd", "fwdbwd")
GiB = 2 ** 30
MiB = 2 ** 20
WARMUP_T = 1024          # the warm-up call's length (at most)
AGREE_TOL = 1e-4         # largest sampled difference / largest |output|
TARGETS = dict(module=2.0, attention=3.0, memory=0.25)
QUICK = dict(hidden=64, heads=2, window=[8, 8], minutes=[0.4], repeats=1, threads=[1])
# NeMo's peak, in [B, H, T_pad, 2w + 1 (+ G)] fp32 tensors per layer: the content and position
# scores, the padding mask's scores, the softmax and its masked copy, the sliding chunks' copies
# of q and k and their [B H, chunks, 2w, 2w] products; with the backward what autograd saves
# stays for every layer of the stack. Read off the extra RSS this script measures (hidden 1024,
# 8 heads, [128, 128], T 1,500, G 1: about 13 such tensors in fwd, 19 in fwdbwd), rounded up.
NEMO_SCORE_TENSORS = {"fwd": 14, "fwdbwd": 20}


def frames(minutes: float) -> int:
    return long_audio.encoder_frames(minutes)


def nemo_score_bytes(T: int, heads: int, window, global_tokens: int, direction: str,
                     layers: int) -> int:
    """An estimate of the memory NeMo's local attention holds at its peak (module docstring)."""
    w = max(window)
    t_pad = T + (2 * w - T % (2 * w)) % (2 * w)
    one = heads * t_pad * (2 * w + 1 + global_tokens) * 4
    return one * NEMO_SCORE_TENSORS[direction] * (layers if direction == "fwdbwd" else 1)


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc ``malloc_trim``), so a call's
    allocations show in its peak RSS rather than reusing pages freed before; no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------
# One point, in a fresh process


def _nemo():
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import originals_nemo_longformer

    return originals_nemo_longformer


def build(variant: str, G: int, args):
    """-> (the stack: a list of modules, the position table)."""
    import torch

    nemo = _nemo()
    torch.manual_seed(0)
    mods = [nemo.RelPositionMultiHeadAttentionLongformer(
        n_head=args.heads, n_feat=args.hidden, dropout_rate=0.0, pos_bias_u=None,
        pos_bias_v=None, att_context_size=list(args.window), global_tokens=G,
        global_tokens_spacing=1, global_attn_separate=args.global_separate)
        for _ in range(args.layers)]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # NeMo initialises the biases to 0: make them matter
        for m in mods:
            for p in (m.pos_bias_u, m.pos_bias_v):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    if variant == "txl":
        from txl_kernels.modules import NeMoRelPositionMultiHeadAttentionLongformer as Ours

        mods = [Ours.from_module(m, backend=args.backend) for m in mods]
    enc = nemo.LocalAttRelPositionalEncoding(list(args.window), d_model=args.hidden,
                                             dropout_rate=0.0)
    enc.extend_pe(1, "cpu", torch.float32)
    pos_emb = enc(torch.zeros(1, 1, args.hidden))[1]
    return mods, pos_emb


def projections(mod) -> list:
    """The module's nn.Linear layers its forward runs, as (layer, what it reads)."""
    out = [(mod.linear_q, "x"), (mod.linear_k, "x"), (mod.linear_v, "x"),
           (mod.linear_pos, "pos"), (mod.linear_out, "y")]
    if mod.global_tokens > 0 and getattr(mod, "global_attn_separate", False):
        out += [(mod.global_q, "x"), (mod.global_k, "x"), (mod.global_v, "x")]
    return out


def _inputs(T: int, hidden: int, pad_frac: float, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, hidden, generator=g)
    grad = torch.randn(1, T, hidden, generator=g)
    pad = torch.zeros(1, T, dtype=torch.bool)
    n_pad = int(round(pad_frac * T))
    if n_pad:
        pad[:, T - n_pad:] = True
    return x, grad, pad


def _measure(fn):
    """(seconds, extra peak RSS in bytes, fn's result) of one call."""
    import gc

    gc.collect()
    trim_heap()
    base = cpu_suite.status_kb("VmRSS")
    if not cpu_suite.reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
    t0 = time.perf_counter()
    res = fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, cpu_suite.status_kb("VmHWM") - base) * 1024, res


def child(variant: str, minutes: float, G: int, threads: int, direction: str, args) -> dict:
    import torch

    torch.set_num_threads(threads)
    T = frames(minutes)
    mods, pos_emb = build(variant, G, args)
    train = direction == "fwdbwd"
    for m in mods:
        m.train(train)
    params = [p for m in mods for p in m.parameters()]

    def stack(x, pad):
        for m in mods:
            x = x + m(x, x, x, pad, pos_emb)
        return x

    def module_call(x, grad, pad):
        if not train:
            with torch.no_grad():
                return stack(x, pad), None
        for p in params:
            p.grad = None
        xx = x.detach().requires_grad_()
        out = stack(xx, pad)
        out.backward(grad)
        return out.detach(), xx.grad

    def projection_call(x, grad, y):
        with torch.set_grad_enabled(train):
            if train:
                for p in params:
                    p.grad = None
                x, y = x.detach().requires_grad_(), y.detach().requires_grad_()
                pos = pos_emb.detach().requires_grad_()
            else:
                pos = pos_emb
            for m in mods:
                outs = [lin({"x": x, "pos": pos, "y": y}[src]) for lin, src in projections(m)]
                if train:
                    torch.autograd.backward(outs, [grad if o.shape == grad.shape
                                                   else torch.ones_like(o) for o in outs])
                del outs

    # warm-up at a short length, then the timed calls
    xw, gw, pw = _inputs(min(T, WARMUP_T), args.hidden, args.pad_frac, seed=3)
    module_call(xw, gw, pw)
    projection_call(xw, gw, gw)
    del xw, gw, pw
    x, grad, pad = _inputs(T, args.hidden, args.pad_frac, seed=2)
    y = torch.randn(1, T, args.hidden, generator=torch.Generator().manual_seed(4))
    mod_s, mod_x, proj_s, proj_x = [], [], [], []
    out = x_grad = None
    for _ in range(args.repeats):
        out = x_grad = None
        s, extra, (out, x_grad) = _measure(lambda: module_call(x, grad, pad))
        mod_s.append(s)
        mod_x.append(extra)
        s, extra, _ = _measure(lambda: projection_call(x, grad, y))
        proj_s.append(s)
        proj_x.append(extra)
    idx = torch.unique(torch.cat([torch.arange(min(T, 4)),
                                  torch.linspace(0, T - 1, 64).long()]))
    rec = dict(variant=variant, minutes=minutes, T=T, G=G, threads=threads,
               direction=direction, layers=args.layers, status="ok",
               module_s=statistics.median(mod_s), projections_s=statistics.median(proj_s),
               module_runs_s=mod_s, projection_runs_s=proj_s,
               module_extra_bytes=max(mod_x), projections_extra_bytes=max(proj_x),
               out_max=float(out.abs().max()),
               fingerprint=out[0, idx, :8].double().flatten().tolist(),
               backend=args.backend if variant == "txl" else "nemo")
    if x_grad is not None:
        rec["grad_max"] = float(x_grad.abs().max())
        rec["grad_fingerprint"] = x_grad[0, idx, :8].double().flatten().tolist()
    rec["attention_s"] = rec["module_s"] - rec["projections_s"]
    rec["attention_extra_bytes"] = rec["module_extra_bytes"] - rec["projections_extra_bytes"]
    return rec


# ---------------------------------------------------------------------------------------------
# The parent


def _child_argv(variant, minutes, G, threads, direction, args) -> list:
    return ["--child", variant, repr(minutes), str(G), str(threads), direction,
            "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
            str(args.heads), "--window", *map(str, args.window), "--repeats",
            str(args.repeats), "--pad-frac", repr(args.pad_frac), "--backend", args.backend,
            *(["--global-separate"] if args.global_separate else [])]


def run_point(variant, minutes, G, threads, direction, args) -> dict:
    key = dict(variant=variant, minutes=minutes, T=frames(minutes), G=G, threads=threads,
               direction=direction)
    if variant == "nemo":
        need = nemo_score_bytes(frames(minutes), args.heads, args.window, G, direction,
                                args.layers)
        avail = cpu_suite.mem_available_bytes()
        if avail is not None and need > cpu_suite.MEMORY_HEADROOM * avail:
            return dict(key, status="not run",
                        reason=f"NeMo's score tensors need about {need / GiB:.1f} GiB; "
                               f"{avail / GiB:.1f} GiB available")
    t0 = time.time()
    rec, why = cpu_suite.run_json_child(str(Path(__file__).resolve()),
                                        _child_argv(variant, minutes, G, threads, direction,
                                                    args), args.timeout_s)
    if rec is None:
        return dict(key, status="failed", reason=why)
    rec["process_s"] = time.time() - t0
    return rec


def agreement(a: dict, b: dict) -> float:
    """Largest sampled difference of the two outputs (and input gradients, for fwdbwd),
    relative to the largest |value| of each."""
    worst = 0.0
    for fp, mx in (("fingerprint", "out_max"), ("grad_fingerprint", "grad_max")):
        if fp in a and fp in b:
            diff = max(abs(x - y) for x, y in zip(a[fp], b[fp]))
            worst = max(worst, diff / max(a[mx], b[mx], 1e-30))
    return worst


def _ratio(num, den):
    return num / den if den and den > 0 and num is not None else None


def _f(v, fmt):
    return "n/a" if v is None else format(v, fmt)


def point_pairs(recs):
    """(minutes, G, threads, direction) -> (nemo record, txl record), both present."""
    by = {}
    for r in recs:
        by.setdefault((r["minutes"], r["G"], r["threads"], r["direction"]), {})[r["variant"]] = r
    return {k: (v.get("nemo"), v.get("txl")) for k, v in sorted(by.items())}


def comparison(n: dict, t: dict) -> dict:
    """Speed-ups (NeMo / ours) and memory ratios (ours / NeMo) of one point."""
    ok = n and t and n["status"] == t["status"] == "ok"
    if not ok:
        return {}
    return dict(module=_ratio(n["module_s"], t["module_s"]),
                attention=_ratio(n["attention_s"], t["attention_s"]),
                module_memory=_ratio(t["module_extra_bytes"], n["module_extra_bytes"]),
                memory=_ratio(max(t["attention_extra_bytes"], 0), n["attention_extra_bytes"]),
                agreement=agreement(n, t))


def table(recs, direction: str, args) -> str:
    L = args.layers
    lines = [f"{direction}: a stack of {L} local-attention module(s) (x = x + attn(x)), hidden "
             f"{args.hidden}, {args.heads} heads, att_context_size {list(args.window)}, fp32, "
             f"batch 1, pad_frac {args.pad_frac:g}; times: median of {args.repeats}, s for the "
             f"stack (per module); extra: peak RSS above the call's baseline, MiB; speed-up = "
             f"NeMo / ours, memory = ours / NeMo.", "",
             "| audio | T | G | threads | NeMo module | ours module | speed-up | NeMo attention "
             "| ours attention | speed-up | NeMo extra module | ours extra module | memory "
             "| NeMo extra attention | ours extra attention | memory | outputs agree |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
             "|---|"]

    def t(r, k):
        return "" if r is None or r["status"] != "ok" else f"{r[k]:.3f} ({r[k] / L:.3f})"

    def m(r, k):
        return "" if r is None or r["status"] != "ok" else f"{r[k] / MiB:.0f}"

    for (mins, G, th, d), (n, o) in point_pairs(recs).items():
        if d != direction:
            continue
        c = comparison(n, o)
        notes = [f"{r['variant']}: {r['status']} ({r['reason']})" for r in (n, o)
                 if r is not None and r["status"] != "ok"]
        agree = (f"{c['agreement']:.1e}" + ("" if c["agreement"] <= AGREE_TOL else " FAILED")
                 if c else "; ".join(notes))
        lines.append(
            f"| {mins:g} min | {frames(mins)} | {G} | {th} | {t(n, 'module_s')} | "
            f"{t(o, 'module_s')} | {_f(c.get('module'), '.2f')} | {t(n, 'attention_s')} | "
            f"{t(o, 'attention_s')} | {_f(c.get('attention'), '.2f')} | "
            f"{m(n, 'module_extra_bytes')} | {m(o, 'module_extra_bytes')} | "
            f"{_f(c.get('module_memory'), '.3f')} | {m(n, 'attention_extra_bytes')} | "
            f"{m(o, 'attention_extra_bytes')} | {_f(c.get('memory'), '.3f')} | {agree} |")
    return "\n".join(lines) + "\n"


def targets(recs, args) -> list:
    """The "targets at the longest length" lines: every (G, threads, direction) point at the
    longest length where both variants ran."""
    pairs = {k: v for k, v in point_pairs(recs).items() if comparison(*v)}
    if not pairs:
        return ["targets: no length where both variants ran"]
    longest = max(k[0] for k in pairs)
    out = [f"targets at the longest length ({longest:g} min, T {frames(longest)}): module "
           f"speed-up >= {TARGETS['module']:g}, attention speed-up >= {TARGETS['attention']:g}, "
           f"attention extra memory <= {TARGETS['memory']:g} of NeMo's"]
    for (mins, G, th, d), pair in pairs.items():
        if mins != longest:
            continue
        c = comparison(*pair)
        checks = [("module speed-up", c["module"], ">=", TARGETS["module"]),
                  ("attention speed-up", c["attention"], ">=", TARGETS["attention"]),
                  ("attention extra memory ratio", c["memory"], "<=", TARGETS["memory"])]
        parts = []
        for name, v, op, bound in checks:
            ok = v is not None and (v >= bound if op == ">=" else v <= bound)
            parts.append(f"{name} {_f(v, '.2f' if op == '>=' else '.3f')} {op} {bound:g}: "
                         f"{'PASS' if ok else 'MISS'}")
        out.append(f"  {d:<6} G={G} threads={th}: " + "; ".join(parts)
                   + f" (module extra memory ratio {_f(c['module_memory'], '.3f')}, info)")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=None,
                    help="audio lengths (default 10 30 60)")
    ap.add_argument("--global-tokens", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default 1 2")
    ap.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=DIRECTIONS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--window", type=int, nargs=2, default=None, metavar=("L", "R"),
                    help="att_context_size (default 128 128)")
    ap.add_argument("--layers", type=int, default=1, help="modules in the stack (default 1)")
    ap.add_argument("--hidden", type=int, default=None, help="default 1024")
    ap.add_argument("--heads", type=int, default=None, help="default 8")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (default 3)")
    ap.add_argument("--pad-frac", type=float, default=0.0,
                    help="fraction of the frames padded at the tail (default 0)")
    ap.add_argument("--global-separate", action="store_true",
                    help="global_attn_separate=True (separate global_q/k/v)")
    ap.add_argument("--backend", default="cpu",
                    help="rel_attention backend of the drop-in (default cpu; 'reference' "
                         "checks the pipeline where the CPU kernel is not built)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per child process")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS,
                    metavar=("VARIANT", "MINUTES", "G", "THREADS", "DIRECTION"))
    args = ap.parse_args(argv)
    defaults = dict(minutes=[10, 30, 60], threads=[1, 2], window=[128, 128], hidden=1024,
                    heads=8, repeats=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick and k in QUICK else v)
    for name in ("repeats", "layers", "hidden", "heads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        ap.error(f"--hidden must be a multiple of --heads, got {args.hidden} and {args.heads}")
    if min(args.window) < 0 or max(args.window) < 1:
        ap.error(f"--window must be two ints >= 0, not both 0, got {args.window}")
    if min(args.threads) < 1 or min(args.minutes) <= 0 or min(args.global_tokens) < 0:
        ap.error(f"--threads must be >= 1, --minutes > 0 and --global-tokens >= 0, got "
                 f"{args.threads}, {args.minutes} and {args.global_tokens}")
    if not 0.0 <= args.pad_frac < 1.0:
        ap.error(f"--pad-frac must be in [0, 1), got {args.pad_frac}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        v, m, G, th, d = args.child
        print(json.dumps(child(v, float(m), int(G), int(th), d, args)), flush=True)
        return 0
    print("\n".join(header_lines("benchmarks/local_attention.py", argv)), flush=True)
    recs = []
    stopped = {}
    flip = False
    for mins in sorted(args.minutes):
        for G in args.global_tokens:
            for th in args.threads:
                for d in args.directions:
                    order = list(args.variants)[::-1] if flip else list(args.variants)
                    flip = not flip
                    for v in order:
                        key = (v, G, th, d)
                        if key in stopped:
                            rec = dict(variant=v, minutes=mins, T=frames(mins), G=G,
                                       threads=th, direction=d, status="not run",
                                       reason=f"stopped at {stopped[key]:g} min")
                        else:
                            rec = run_point(v, mins, G, th, d, args)
                            if rec["status"] != "ok":
                                stopped[key] = mins
                        recs.append(rec)
                        what = (f"module {rec['module_s']:.3f} s, projections "
                                f"{rec['projections_s']:.3f} s, extra "
                                f"{rec['module_extra_bytes'] / MiB:.0f} MiB (projections "
                                f"{rec['projections_extra_bytes'] / MiB:.0f})"
                                if rec["status"] == "ok" else
                                f"{rec['status']}: {rec['reason']}")
                        print(f"  {mins:>5g} min T={frames(mins):<6} G={G} threads={th} {d:<6} "
                              f"{v:<4} {what}", flush=True)
    bad = []
    for k, pair in point_pairs(recs).items():
        c = comparison(*pair)
        if c and c["agreement"] > AGREE_TOL:
            bad.append(f"{k}: {c['agreement']:.2e}")
    print()
    for d in args.directions:
        print(table(recs, d, args))
    print("\n".join(targets(recs, args)))
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))
    if bad:
        print(f"\nOUTPUTS DISAGREE (relative difference above {AGREE_TOL:g}) at "
              f"(minutes, G, threads, direction): " + "; ".join(bad), flush=True)
    failed = [r for r in recs if r["status"] in ("failed",) and r["variant"] == "txl"]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
