#!/usr/bin/env python
"""A whole Conformer encoder over long audio on the CPU, in one pass: the Hugging Face Parakeet
encoder (transformers 5.x, random weights) with the txl_kernels drop-in swapped in, next to the
unswapped encoder.

    python benchmarks/long_audio.py                       # 1, 2.5, 5, 10 and 20 minutes
    python benchmarks/long_audio.py --minutes 10 --layers 24   # the full-depth encoder
    python benchmarks/long_audio.py --minutes 0.2 0.4 --hidden 256 --layers 1 \\
        --backend reference                                # pipeline check
    python benchmarks/long_audio.py --minutes 10 30 60 --variants swapped --timeout-s 14400
                                                     # full attention to an hour (swapped only)
    python benchmarks/long_audio.py --attention local --window 128 128 --minutes 60 \\
        --layers 24 --variants swapped --timeout-s 7200   # the whole encoder, local attention

Audio length -> frames: 100 mel frames per second (10 ms hop), 8x subsampling, so 12.5
encoder frames per second: 10 minutes = 60,000 mel frames in, 7,500 encoder frames through the
attention (T; its position term has R = 2T - 1 rows). The encoder is ``ParakeetEncoder`` with
the default Parakeet config (hidden 1024, 8 heads of head dim 128, feed-forward 4096, conv
kernel 9, 256 subsampling channels, 80 mel bins) but ``--layers`` blocks (default 2, to fit
the time; the blocks' cost is linear in the depth, so the table also gives time per block).

Each (variant, length) runs in a fresh process under ``torch.no_grad()`` in eval mode:
``swapped`` (``swap_rel_pos_attention(encoder, backend=--backend)``, "cpu" by default: the
fused CPU kernel) and ``unswapped`` (transformers' own attention, its default implementation,
printed). The process reads its RSS before the forward (interpreter, torch, weights and the
input features: the baseline), resets the peak RSS (``/proc/self/clear_refs``) and reports the
forward's wall time, the peak RSS and the extra above the baseline. A variant whose attention
would not fit in the available memory (estimated from the dense tensors the original builds
per layer) is not started, and neither is any longer length; a process the kernel kills is
reported as such (the swapped variant is never held back by the estimate: its attention holds
no tensor larger than ``O(T)``). Both variants get the same weights and input, and the script
checks that their outputs agree where both ran. After the table, a "memory linear in T" line per
variant gives the extra RSS per 1,000 encoder frames at each length and the ratio of the longest
length's extra / T to the shortest's (1.0 = exactly linear).

``--attention local --window L R``: every attention module of the swapped encoder runs local
attention (``ParakeetEncoderAttention.window_size = (L, R)``: frame ``i`` attends frames ``i - L``
to ``i + R``), the rest of the blocks (feed-forward, convolution) unchanged; transformers' own
``ParakeetEncoderAttention`` has no local attention, so the unswapped variant is not run in this
mode (said when asked for). Global tokens are not offered here (the HF encoder has none; NeMo's
local attention with global tokens is ``benchmarks/local_attention.py``).

``--plot PATH`` writes a PNG of time and peak RSS against the audio length (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_suite  # noqa: E402  (torch-free)
from benchmarks.shapes import all_cores  # noqa: E402

MEL_PER_S = 100        # mel frames per second of audio (10 ms hop)
SUBSAMPLING = 8        # Parakeet's subsampling_factor
FRAMES_PER_S = MEL_PER_S / SUBSAMPLING
GiB = 2 ** 30
VARIANTS = ("swapped", "unswapped")


def encoder_frames(minutes: float) -> int:
    return int(round(minutes * 60 * FRAMES_PER_S))


def unswapped_attention_bytes(T: int, heads: int, itemsize: int = 4) -> int:
    """The dense tensors HF's ParakeetEncoderAttention holds at its peak for one sequence of T
    encoder frames: BD ``[1, H, T, 2T - 1]``, its padded copy, the sliced and scaled float mask
    ``[1, H, T, T]`` and the attention's own ``[1, H, T, T]`` work (SDPA's math path or the
    eager scores)."""
    R = 2 * T - 1
    return heads * T * (2 * (R + 1) + 2 * T) * itemsize


def memory_skip_reason(variant: str, T: int, args, available) -> str:
    """Why the point (variant, T encoder frames) is not started, or "" to run it: only the
    unswapped variant's dense attention tensors (:func:`unswapped_attention_bytes`) are held
    against ``available`` bytes (None = unknown: run); the swapped encoder's memory is linear
    in T (no tensor of its attention larger than O(T)), so it always runs."""
    if variant != "unswapped" or available is None:
        return ""
    need = unswapped_attention_bytes(T, args.heads)
    if need <= cpu_suite.MEMORY_HEADROOM * available:
        return ""
    return (f"its attention needs about {need / GiB:.1f} GiB per layer (BD [1, {args.heads}, "
            f"{T}, {2 * T - 1}] and its copies); {available / GiB:.1f} GiB available")


def attention_note(args) -> str:
    return ("full attention" if args.attention == "full" else
            f"local attention, window [{args.window[0]}, {args.window[1]}] (swapped only)")


def build_encoder(args):
    import torch
    from transformers import ParakeetEncoder, ParakeetEncoderConfig

    cfg = ParakeetEncoderConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                intermediate_size=4 * args.hidden,
                                num_hidden_layers=args.layers, dropout=0.0,
                                dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0,
                                attention_dropout=0.0)
    torch.manual_seed(0)
    enc = ParakeetEncoder(cfg).eval()
    with torch.no_grad():  # the zero-initialised position biases: make them matter
        g = torch.Generator().manual_seed(1)
        for name, p in enc.named_parameters():
            if name.endswith(("bias_u", "bias_v")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return enc, cfg


def child(variant: str, minutes: float, args) -> dict:
    """One forward of the encoder over ``minutes`` of audio, in this (fresh) process."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    enc, cfg = build_encoder(args)
    swapped = 0
    if variant == "swapped":
        from txl_kernels.modules.swap import swap_rel_pos_attention

        swapped = swap_rel_pos_attention(enc, backend=args.backend)
        if swapped != args.layers:
            raise RuntimeError(f"swap_rel_pos_attention replaced {swapped} modules, expected "
                               f"{args.layers}")
        if args.attention == "local":
            from txl_kernels.modules import ParakeetEncoderAttention

            for m in enc.modules():
                if isinstance(m, ParakeetEncoderAttention):
                    m.window_size = tuple(args.window)
    elif args.attention != "full":
        raise ValueError(f"--attention {args.attention}: the unswapped encoder (transformers' "
                         f"ParakeetEncoderAttention) has full attention only")
    mel = encoder_frames(minutes) * SUBSAMPLING
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        enc(torch.randn(1, 16 * SUBSAMPLING, cfg.num_mel_bins, generator=g))  # load everything
        feats = torch.randn(1, mel, cfg.num_mel_bins, generator=g)
        gc.collect()
        base_kb = cpu_suite.status_kb("VmRSS")
        if not cpu_suite.reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
        t0 = time.perf_counter()
        out = enc(feats).last_hidden_state
        seconds = time.perf_counter() - t0
    peak_kb = cpu_suite.status_kb("VmHWM")
    T = out.shape[1]
    idx = torch.linspace(0, T - 1, 16).long()
    return dict(variant=variant, minutes=minutes, T=T, mel_frames=mel, status="ok",
                seconds=seconds, peak_bytes=peak_kb * 1024,
                extra_bytes=max(0, peak_kb - base_kb) * 1024, base_bytes=base_kb * 1024,
                swapped_modules=swapped, attn_implementation=str(cfg._attn_implementation),
                attention=args.attention,
                window=list(args.window) if args.attention == "local" else None,
                backend=args.backend if variant == "swapped" else "transformers",
                fingerprint=out[0, idx, :8].double().flatten().tolist(),
                out_scale=float(out.abs().mean()))


def run_child(variant: str, minutes: float, args) -> dict:
    argv = ["--child", variant, str(minutes), "--layers", str(args.layers), "--hidden",
            str(args.hidden), "--heads", str(args.heads), "--threads", str(args.threads),
            "--backend", args.backend, "--attention", args.attention,
            "--window", *map(str, args.window)]
    t0 = time.time()
    rec, why = cpu_suite.run_json_child(str(Path(__file__).resolve()), argv, args.timeout_s)
    if rec is None:
        return dict(variant=variant, minutes=minutes, status="failed", reason=why)
    rec["process_s"] = time.time() - t0
    return rec


def agreement(a: dict, b: dict) -> float:
    """Largest difference of the two outputs' sampled values, relative to their mean size."""
    diff = max(abs(x - y) for x, y in zip(a["fingerprint"], b["fingerprint"]))
    return diff / max(a["out_scale"], 1e-30)


def table(recs, args) -> str:
    out = [f"ParakeetEncoder, hidden {args.hidden}, {args.heads} heads, {args.layers} "
           f"block(s), {attention_note(args)}, fp32, batch 1, {args.threads} thread(s); "
           f"swapped: rel_attention(backend={args.backend!r}).", "",
           "| audio | encoder frames T | variant | time (s) | time / block (s) | peak RSS (GiB) "
           "| extra RSS (GiB) | note |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    by = {(r["minutes"], r["variant"]): r for r in recs}
    for m in sorted({r["minutes"] for r in recs}):
        for v in VARIANTS:
            r = by.get((m, v))
            if r is None:
                continue
            T = r.get("T", encoder_frames(m))
            if r["status"] == "ok":
                note = f"attn_implementation {r['attn_implementation']}" if v == "unswapped" \
                    else f"{r['swapped_modules']} modules swapped"
                other = by.get((m, "unswapped" if v == "swapped" else "swapped"))
                if v == "swapped" and other and other["status"] == "ok":
                    note += (f"; {other['seconds'] / r['seconds']:.2f}x faster, "
                             f"{other['extra_bytes'] / max(r['extra_bytes'], 1):.1f}x less extra "
                             f"memory; outputs agree to {agreement(r, other):.1e} (relative)")
                out.append(f"| {m:g} min | {T} | {v} | {r['seconds']:.2f} | "
                           f"{r['seconds'] / args.layers:.2f} | {r['peak_bytes'] / GiB:.2f} | "
                           f"{r['extra_bytes'] / GiB:.2f} | {note} |")
            else:
                out.append(f"| {m:g} min | {T} | {v} | | | | | {r['status']}: {r['reason']} |")
    return "\n".join(out) + "\n"


def linearity_lines(recs) -> list:
    """Per variant with at least one length run: "memory linear in T", the extra RSS per 1,000
    encoder frames at each length and the ratio of the longest length's extra / T to the
    shortest's (1.0: exactly linear; above 1: growing faster than T)."""
    out = []
    for v in VARIANTS:
        ok = sorted((r for r in recs if r["variant"] == v and r["status"] == "ok"),
                    key=lambda r: r["T"])
        if not ok:
            continue
        per = [r["extra_bytes"] / r["T"] * 1000 for r in ok]
        line = (f"{v}: memory linear in T: extra RSS per 1,000 frames "
                + ", ".join(f"{r['minutes']:g} min (T {r['T']}) {p / 2 ** 20:.1f} MiB"
                            for r, p in zip(ok, per)))
        if len(ok) > 1:
            line += (f"; (extra / T) at {ok[-1]['minutes']:g} min / at {ok[0]['minutes']:g} min "
                     f"= {per[-1] / max(per[0], 1e-30):.2f}")
        out.append(line)
    return out


def plot(recs, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for v in VARIANTS:
        ok = sorted((r for r in recs if r["variant"] == v and r["status"] == "ok"),
                    key=lambda r: r["minutes"])
        if not ok:
            continue
        label = (f"swapped (rel_attention backend={args.backend!r})" if v == "swapped"
                 else "unswapped (transformers)")
        xs = [r["minutes"] for r in ok]
        ax_t.plot(xs, [r["seconds"] for r in ok], marker="o", label=label)
        ax_m.plot(xs, [r["peak_bytes"] / GiB for r in ok], marker="o", label=label)
        for r in recs:
            if r["variant"] == v and r["status"] != "ok":
                ax_m.annotate(f"{v}: {r['status']} at {r['minutes']:g} min",
                              (r["minutes"], ax_m.get_ylim()[1] * 0.9), fontsize=7, color="red")
    for ax, name in ((ax_t, "forward time (s)"), (ax_m, "peak RSS (GiB)")):
        ax.set_xlabel("audio (minutes; 12.5 encoder frames per second)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ParakeetEncoder, hidden {args.hidden}, {args.heads} heads, {args.layers} "
                 f"block(s), {attention_note(args)}, fp32, {args.threads} thread(s), CPU",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, nargs="*", default=[1, 2.5, 5, 10, 20])
    ap.add_argument("--layers", type=int, default=2, help="Conformer blocks (default 2)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=all_cores())
    ap.add_argument("--backend", default="cpu",
                    help="rel_attention backend of the drop-in (default cpu; 'reference' "
                         "checks the pipeline where the CPU kernel is not built)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--attention", default="full", choices=("full", "local"),
                    help="full (default) or local attention in every block (swapped only; "
                         "no global tokens: the HF encoder has none)")
    ap.add_argument("--window", type=int, nargs=2, default=[128, 128], metavar=("L", "R"),
                    help="--attention local: frame i attends frames i - L to i + R "
                         "(default 128 128)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per child process")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "MINUTES"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], float(args.child[1]), args)), flush=True)
        return 0
    print("\n".join(cpu_suite.machine_lines()), flush=True)
    print(f"command: python benchmarks/long_audio.py {' '.join(argv or sys.argv[1:])}",
          flush=True)
    variants = list(args.variants)
    if args.attention == "local" and "unswapped" in variants:
        variants.remove("unswapped")
        print("unswapped: not run with --attention local (transformers' ParakeetEncoderAttention "
              "has full attention only)", flush=True)
    recs = []
    stopped = {}
    for m in sorted(args.minutes):
        T = encoder_frames(m)
        for v in variants:
            if v in stopped:
                rec = dict(variant=v, minutes=m, T=T, status="not run",
                           reason=f"stopped at {stopped[v]:g} min")
            else:
                why = memory_skip_reason(v, T, args, cpu_suite.mem_available_bytes())
                if why:
                    rec = dict(variant=v, minutes=m, T=T, status="not run", reason=why)
                else:
                    rec = run_child(v, m, args)
                if rec["status"] != "ok":
                    stopped[v] = m
            recs.append(rec)
            what = (f"{rec['seconds']:.2f} s ({rec['seconds'] / args.layers:.2f} s per block), "
                    f"peak RSS {rec['peak_bytes'] / GiB:.2f} GiB "
                    f"(extra {rec['extra_bytes'] / GiB:.2f})" if rec["status"] == "ok"
                    else f"{rec['status']}: {rec['reason']}")
            print(f"  {m:>5g} min  T={T:<6} {v:<9} {what}", flush=True)
    print()
    print(table(recs, args))
    for line in linearity_lines(recs):
        print(line)
    for v, m in stopped.items():
        print(f"{v}: stops at {m:g} minutes of audio ({encoder_frames(m)} encoder frames).")
    if args.plot:
        plot(recs, args.plot, args)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(recs, indent=1))
    bad = [r for r in recs if r["status"] in ("failed", "timed out") and r["variant"] == "swapped"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
