"""Benchmark records -> ratios, markdown tables, the BENCHMARKS.md results section, the plot.

Pure Python (matplotlib is imported only by :func:`plot`), so it is cheap to test on synthetic
records. A record is a dict made by ``runner.run_case`` with at least: kind, key (the case:
every provider of one case shares it), group, label, dtype, mode, provider, status ("ok",
"oom", "skipped", "error"), reason, time_s, tflops, bandwidth_gbs, peak_bytes, seqlen, series.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

from .shapes import BASELINES, FLOP_CONVENTION, KIND_ORDER, PROVIDER_ORDER

BEGIN = "<!-- benchmark-results:begin -->"
END = "<!-- benchmark-results:end -->"

KIND_TITLES = {
    "attention": "Attention level (`rel_attention` inputs, every provider on the same tensors)",
    "conformer_module": "Conformer module level (NeMo and ESPnet drop-ins, projections included)",
    "update_mems": "update_mems (all layers)",
}


def add_ratios(records: List[dict]) -> List[dict]:
    """For every record, against every other provider of its case:

    ``speedup_vs[X]``   = X's median time / this record's median time (> 1: faster than X);
    ``mem_ratio_vs[X]`` = X's peak memory / this record's peak memory (> 1: uses less);
    the string ``"OOM"`` where X ran out of memory and this record did not.
    Records that did not run (status != "ok") get empty dicts. Mutates and returns ``records``.
    """
    by_case: Dict[str, List[dict]] = OrderedDict()
    for rec in records:
        by_case.setdefault(rec["key"], []).append(rec)
    for recs in by_case.values():
        for rec in recs:
            speed, mem = {}, {}
            if rec.get("status") == "ok" and rec.get("time_s"):
                for other in recs:
                    name = other["provider"]
                    if other is rec or name == rec["provider"]:
                        continue
                    if other.get("status") == "oom":
                        speed[name] = mem[name] = "OOM"
                    elif other.get("status") == "ok" and other.get("time_s"):
                        speed[name] = other["time_s"] / rec["time_s"]
                        if other.get("peak_bytes") and rec.get("peak_bytes"):
                            mem[name] = other["peak_bytes"] / rec["peak_bytes"]
            rec["speedup_vs"] = speed
            rec["mem_ratio_vs"] = mem
    return records


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return ""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    if n >= 2 ** 30:
        return f"{n / 2 ** 30:.2f} GiB"
    return f"{n / 2 ** 20:.1f} MiB"


def fmt_num(x: Optional[float]) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return ""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def fmt_ratio(speed, mem) -> str:
    if speed is None:
        return ""
    if speed == "OOM":
        return "X OOM"
    s = f"{speed:.2f}x"
    if isinstance(mem, (int, float)):
        s += f" / {mem:.2f}x"
    return s


def _status_cell(rec: dict) -> str:
    st = rec.get("status")
    if st == "oom":
        return "OOM"
    if st == "skipped":
        return "skipped"
    if st == "error":
        return "error"
    return fmt_time(rec.get("time_s"))


def _ordered(records: Iterable[dict]) -> "OrderedDict[str, List[dict]]":
    """Records grouped by kind then case (first-seen order), providers in PROVIDER_ORDER."""
    kinds: "OrderedDict[str, OrderedDict[str, List[dict]]]" = OrderedDict()
    for kind in KIND_ORDER:
        kinds[kind] = OrderedDict()
    for rec in records:
        kinds.setdefault(rec["kind"], OrderedDict()).setdefault(rec["key"], []).append(rec)
    for kind, cases in kinds.items():
        order = PROVIDER_ORDER.get(kind, ())
        for key, recs in cases.items():
            recs.sort(key=lambda r: order.index(r["provider"]) if r["provider"] in order else 99)
    return kinds


def format_markdown(records: List[dict], include_skipped: bool = True,
                    heading: str = "###") -> str:
    """Markdown tables, one per kind: time, TFLOP/s (GB/s for update_mems), peak memory, and
    against each baseline ``speed-up / memory ratio``. Ratios are computed here if missing."""
    if any("speedup_vs" not in r for r in records):
        add_ratios(records)
    out: List[str] = []
    for kind, cases in _ordered(records).items():
        if not cases:
            continue
        baselines = BASELINES.get(kind, ())
        rate = "GB/s" if kind == "update_mems" else "TFLOP/s"
        out.append(f"{heading} {KIND_TITLES.get(kind, kind)}\n")
        head = ["case", "dtype", "mode", "provider", "time (ms)", rate, "peak mem"]
        head += [f"vs {b}" for b in baselines]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|")
        notes: List[str] = []
        for key, recs in cases.items():
            for rec in recs:
                if rec.get("status") == "skipped" and not include_skipped:
                    continue
                rate_val = rec.get("bandwidth_gbs") if kind == "update_mems" else rec.get("tflops")
                cells = [f"{rec['group']} {rec['label']}", rec["dtype"], rec["mode"],
                         rec["provider"], _status_cell(rec),
                         fmt_num(rate_val),
                         fmt_bytes(rec.get("peak_bytes")) if rec.get("status") == "ok" else ""]
                for b in baselines:
                    if b == rec["provider"]:
                        cells.append("—")
                    else:
                        cells.append(fmt_ratio(rec.get("speedup_vs", {}).get(b),
                                               rec.get("mem_ratio_vs", {}).get(b)))
                out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
                if rec.get("status") in ("skipped", "error") and rec.get("reason"):
                    notes.append(f"- {rec['provider']} on {rec['group']} {rec['label']} "
                                 f"{rec['dtype']} {rec['mode']}: {rec['status']}: {rec['reason']}")
        warm = []
        for recs in cases.values():
            for rec in recs:
                if rec.get("status") == "ok" and rec.get("note"):
                    line = f"- {rec['provider']}: {rec['note']}"
                    if line not in warm:
                        warm.append(line)
        out.append("")
        if warm:
            out.append("Warnings at the warm-up call:\n")
            out += warm[:20]
            out.append("")
        if notes:
            # One line per distinct reason keeps the table readable.
            seen, uniq = set(), []
            for n in notes:
                tail = n.split(": ", 1)[1]
                if tail not in seen:
                    seen.add(tail)
                    uniq.append(n)
            out.append("Not run:\n")
            out += uniq
            out.append("")
    out.append(legend())
    return "\n".join(out).rstrip() + "\n"


def legend() -> str:
    return (
        "Time: median of `triton.testing.do_bench` (GPU: CUDA events, L2 flushed between "
        "calls) or of `torch.utils.benchmark.Timer.blocked_autorange` (CPU). "
        + FLOP_CONVENTION + " Peak mem: `torch.cuda.max_memory_allocated` after a reset, inputs "
        "included. `vs X`: X's time / this row's time (> 1 = faster than X) / X's peak memory / "
        "this row's peak memory (> 1 = less memory); `X OOM`: X ran out of memory on this case."
    )


def summary_lines(records: List[dict], ours: Optional[Dict[str, str]] = None) -> List[str]:
    """One line per case of the first dtype (update_mems: every case): this library's provider
    (``fused``, ``nemo_fused``, ``update_mems``) against each baseline, for a headline."""
    ours = ours or {k: v[0] for k, v in PROVIDER_ORDER.items()}
    if any("speedup_vs" not in r for r in records):
        add_ratios(records)
    first = next((r["dtype"] for r in records if r["kind"] != "update_mems"), None)
    lines = []
    for kind, cases in _ordered(records).items():
        for key, recs in cases.items():
            if kind != "update_mems" and recs[0]["dtype"] != first:
                continue
            mine = [r for r in recs if r["provider"] == ours.get(kind) and r["status"] == "ok"]
            if not mine:
                continue
            r = mine[0]
            parts = [f"{b} {fmt_ratio(r['speedup_vs'].get(b), None)}"
                     for b in BASELINES.get(kind, ()) if b in r["speedup_vs"]]
            lines.append(f"{r['group']} {r['label']} {r['dtype']} {r['mode']}: "
                         + (", ".join(parts) if parts else "no baseline ran"))
    return lines


def update_section(md_text: str, body: str) -> str:
    """Replace what lies between the results markers with ``body`` (markers kept); append the
    markers and body at the end when the markers are missing."""
    block = f"{BEGIN}\n{body.rstrip()}\n{END}"
    if BEGIN in md_text and END in md_text and md_text.index(BEGIN) < md_text.index(END):
        pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
        return pattern.sub(lambda _m: block, md_text, count=1)
    return md_text.rstrip() + "\n\n" + block + "\n"


def results_section(records: List[dict], env: Dict[str, str], command: str,
                    tests_line: str, plot_rel: Optional[str]) -> str:
    lines = [f"### Latest run: {env.get('date', '?')}, {env.get('gpu', '?')}", ""]
    lines.append(f"- Date: {env.get('date', '?')}")
    lines.append(f"- GPU: {env.get('gpu', '?')}")
    lines.append(f"- torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
                 f"CUDA {env.get('cuda', '?')}, Python {env.get('python', '?')}")
    lines.append(f"- Command: `{command}`")
    lines.append(f"- Correctness tests: {tests_line}")
    lines.append("")
    head = summary_lines(records)
    if head:
        lines.append("Headline: this library (`fused`, `nemo_fused`, `update_mems`) against "
                     "each baseline, time ratio (> 1 = faster); `X OOM` = the baseline ran out "
                     "of memory. Full tables below.")
        lines.append("")
        lines += [f"- {h}" for h in head]
        lines.append("")
    if plot_rel:
        lines.append(f"![time and peak memory against sequence length]({plot_rel})")
        lines.append("")
    lines.append(format_markdown(records, heading="####"))
    return "\n".join(lines)


def plot(records: List[dict], path: str, title: str = "") -> Optional[str]:
    """PNG of median time (upper panel) and peak memory (lower panel) against sequence length,
    one panel pair per series (group, batch, heads, mode) in the first dtype of the records,
    one line per provider; only series with several lengths when there are any. Only what was
    measured is drawn: without any peak memory (CPU runs) there is no memory row. Returns the
    path, or None if nothing ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [r["dtype"] for r in records if r["kind"] != "update_mems"]
    first_dtype = dtypes[0] if dtypes else None  # one dtype keeps the figure readable
    series: "OrderedDict[str, List[dict]]" = OrderedDict()
    for rec in records:
        if rec["kind"] == "update_mems" or rec["dtype"] != first_dtype:
            continue
        series.setdefault(rec["series"], []).append(rec)
    series = OrderedDict((k, v) for k, v in series.items()
                         if any(r["status"] == "ok" for r in v))
    multi = OrderedDict((k, v) for k, v in series.items()
                        if len({r["seqlen"] for r in v if r["status"] == "ok"}) > 1)
    if multi:  # lines against sequence length where a series has several lengths
        series = multi
    if not series:
        return None
    with_mem = any(r["status"] == "ok" and r["peak_bytes"] for v in series.values() for r in v)
    per = 2 if with_mem else 1  # panel rows per series
    n = len(series)
    ncols = min(4, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(per * nrows, ncols, figsize=(4.2 * ncols, 3.2 * per * nrows + 0.6),
                             squeeze=False)
    order = [p for names in PROVIDER_ORDER.values() for p in names]
    for idx, (name, recs) in enumerate(series.items()):
        row, col = per * (idx // ncols), idx % ncols
        ax_t = axes[row][col]
        ax_m = axes[row + 1][col] if with_mem else None
        provs = sorted({r["provider"] for r in recs},
                       key=lambda p: order.index(p) if p in order else 99)
        ooms = []
        for p in provs:
            pts = sorted((r for r in recs if r["provider"] == p), key=lambda r: r["seqlen"])
            ok = [r for r in pts if r["status"] == "ok"]
            ooms += [f"{p} OOM at {r['seqlen']}" for r in pts if r["status"] == "oom"]
            if ok:
                xs = [r["seqlen"] for r in ok]
                ax_t.plot(xs, [r["time_s"] * 1e3 for r in ok], marker="o", label=p)
                mem = [(r["seqlen"], r["peak_bytes"] / 2 ** 30) for r in ok if r["peak_bytes"]]
                if mem and ax_m is not None:
                    ax_m.plot([m[0] for m in mem], [m[1] for m in mem], marker="o", label=p)
        for ax in (ax_t, ax_m):
            if ax is None:
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("sequence length (keys)", fontsize=8)
            ax.tick_params(labelsize=7)
        ax_t.set_title(name, fontsize=8)
        ax_t.set_ylabel("median time (ms)", fontsize=8)
        if ax_m is not None:
            ax_m.set_ylabel("peak memory (GiB)", fontsize=8)
            if not ax_m.lines:
                ax_m.text(0.5, 0.5, "peak memory: not measured", transform=ax_m.transAxes,
                          ha="center", fontsize=8)
        if ooms:
            ax_o = ax_m if ax_m is not None else ax_t
            ax_o.text(0.02, 0.98, "\n".join(ooms), transform=ax_o.transAxes, fontsize=7,
                      va="top", color="red")
        ax_t.legend(fontsize=7)
    for idx in range(n, nrows * ncols):
        row, col = per * (idx // ncols), idx % ncols
        for r in range(per):
            axes[row + r][col].axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
        # keep the top band for the title, so it never overlaps the first row's titles
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
