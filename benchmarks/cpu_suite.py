"""The fused CPU kernel's benchmark: what the machine is, which dense baseline fits in its
memory, and the ratios the kernel is measured against.

Used by ``benchmarks/test_bench_cpu_kernel.py`` (kind ``cpu_attention``; the runner skips a
provider up front when :func:`memory_skip_reason` says its dense tensors would not fit), by
``benchmarks/conftest.py`` (:func:`summary` at the end of the run) and by
``benchmarks/cpu_memory.py`` / ``benchmarks/long_audio.py`` (:func:`machine_lines`). Torch-free
at import.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .shapes import FWD, FWD_BWD, Case

GiB = 2 ** 30
ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The machine


def cpu_flags() -> Tuple[str, ...]:
    """The first processor's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ()


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16() -> Tuple[bool, str]:
    """Whether the CPU does bf16 arithmetic natively (AVX512-BF16 dot products or AMX), and the
    sentence that says which flag decided it."""
    flags = set(cpu_flags())
    have = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if have:
        return True, f"native bf16: the CPU has {', '.join(have)}"
    vec = "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "no AVX2")
    return False, (f"no native bf16: neither {' nor '.join(NATIVE_BF16_FLAGS)} in the CPU flags "
                   f"(widest vector ISA: {vec}); bf16 would be converted to fp32 in software")


def bf16_wanted() -> Tuple[bool, str]:
    """Whether the CPU matrix adds bf16 cases: where the CPU has native bf16, or when
    ``TXL_BENCH_CPU_BF16=1`` asks for them anyway."""
    from .shapes import CPU_BF16_ENV

    native, why = native_bf16()
    if native:
        return True, why
    if os.environ.get(CPU_BF16_ENV) == "1":
        return True, why + f" (timed anyway: {CPU_BF16_ENV}=1)"
    return False, why + f": bf16 not timed ({CPU_BF16_ENV}=1 times it anyway)"


def cpu_dtypes() -> Tuple[str, ...]:
    """The dtypes the CPU matrix times: fp32, and bf16 where :func:`bf16_wanted`."""
    return ("fp32", "bf16") if bf16_wanted()[0] else ("fp32",)


def meminfo() -> Dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, rest = line.split(":", 1)
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def mem_available_bytes() -> Optional[int]:
    """What a new allocation can get without swapping or the OOM killer: MemAvailable, capped
    by the cgroup's memory limit when one is set."""
    info = meminfo()
    avail = info.get("MemAvailable")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            lim = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            cur = int(f.read().strip())
        if lim.isdigit():
            room = int(lim) - cur
            avail = room if avail is None else min(avail, room)
    except OSError:
        pass
    return avail


def machine_lines() -> List[str]:
    """The machine, for the results: CPU model, cores, vector ISA, bf16, memory, versions."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
        if m:
            model = m.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from .shapes import all_cores

    info = meminfo()
    flags = set(cpu_flags())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
           if f in flags]
    return [
        f"CPU: {model}, {all_cores()} cores usable (nproc), flags {' '.join(isa) or 'n/a'}; "
        f"{native_bf16()[1]}",
        f"memory: {info.get('MemTotal', 0) / GiB:.1f} GiB total, "
        f"{info.get('MemAvailable', 0) / GiB:.1f} GiB available",
        f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} intra-op threads by default), Python "
        f"{platform.python_version()}",
    ]


# ---------------------------------------------------------------------------------------------
# Peak RSS of one call, in a fresh process (cpu_memory.py, long_audio.py)


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: now, ``VmHWM``: the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False where
    that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_json_child(script: str, argv: Sequence[str], timeout_s: float,
                   env: Optional[Dict[str, str]] = None,
                   memory_reserve: Optional[int] = None) -> Tuple[Optional[dict], str]:
    """Run ``python script argv...`` in a fresh process with the repository on the path;
    return (the last JSON line it printed, "") or (None, why it gave none: killed by a signal,
    timed out, out of memory, or its exit status and last line of stderr).

    ``memory_reserve`` (bytes): a watchdog thread polls the machine's available memory
    (:func:`mem_available_bytes`) and the child's RSS, and kills the child when the available
    memory falls below the reserve, before the kernel's OOM killer picks a process of its own
    choosing; the reason then reads "out of memory at X GiB" (the child's RSS when killed)."""
    import threading

    cmd = [sys.executable, script, *argv]
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=ROOT)
    killed: List[int] = []   # the child's RSS when the watchdog killed it
    done = threading.Event()
    if memory_reserve is not None:
        threading.Thread(target=_watch_memory, args=(proc, memory_reserve, done, killed),
                         daemon=True).start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, f"timed out after {timeout_s:.0f} s"
    finally:
        done.set()
    if killed:
        return None, (f"out of memory at {killed[0] / GiB:.1f} GiB (RSS when the watchdog "
                      f"stopped it, {memory_reserve / GiB:.1f} GiB of the machine left)")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1]), ""
    if proc.returncode < 0:
        return None, f"killed by signal {-proc.returncode} (out of memory?)"
    last = (err.strip().splitlines() or [""])[-1][:300]
    return None, f"exit {proc.returncode}: {last}"


def _watch_memory(proc: subprocess.Popen, reserve: int, done, killed: List[int],
                  every_s: float = 0.05) -> None:
    """Kill ``proc`` when the machine's available memory falls below ``reserve`` bytes; its
    RSS at that moment goes into ``killed``."""
    while not done.wait(every_s):
        avail = mem_available_bytes()
        if avail is not None and avail < reserve:
            killed.append(process_rss_bytes(proc.pid))
            proc.kill()
            return


def process_rss_bytes(pid: int) -> int:
    """A process's RSS in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# Which dense baseline fits

# Dense tensors alive at a provider's peak, as counts of [B, H, Lq, Lk] ("k") and [B, H, Lq, R]
# ("r") tensors: an upper estimate read off the code (providers.py, txl_kernels/reference.py)
# and checked against the peak RSS that benchmarks/cpu_memory.py measures (Conformer shape,
# R = 2T - 1, T = 512 to 2,048: reference about 8.2 [B, H, T, T] tensors, sdpa_bias 5.0,
# nemo_eager 5.3, forward and forward + backward alike; the estimates below are 9, 6 and 7, and
# 10, 7 and 7 with the backward, where the profiler sees 9.1 and 6.0 for the first two at short
# lengths; tests/test_bench_cpu_kernel.py checks them against the allocator's peak).
# The reference path holds its scores in fp32 whatever the input dtype (fp64 for fp64 inputs).
#   reference: AC, BD before the shift (R wide) and its padded copy (about R wide), the scores
#     and a temporary; forward + backward frees the forward's tensors as the gradients come.
#   sdpa_bias: BD, its padded copy and the sliced, scaled float mask.
#   nemo_eager: AC, BD and its padded copy, scores, softmax.
DENSE_COUNTS: Dict[str, Dict[str, Tuple[int, int]]] = {
    "reference": {FWD: (5, 2), FWD_BWD: (6, 2)},
    "sdpa_bias": {FWD: (2, 2), FWD_BWD: (3, 2)},
    "nemo_eager": {FWD: (3, 2), FWD_BWD: (3, 2)},
}
_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
#: fraction of the available memory a provider may plan to use (the rest: inputs, the
#: interpreter, the allocator's slack)
MEMORY_HEADROOM = 0.85


def dense_bytes(case: Case, provider: str) -> int:
    """Estimated bytes of the dense score tensors ``provider`` holds at its peak on ``case``
    (0 for the fused kernel and SDPA without a position term, whose extra memory is linear),
    and for the reference its k / v / r copies with non-finite entries zeroed (linear: they
    matter only at small T), saved for the backward, and their gradients."""
    counts = DENSE_COUNTS.get(provider)
    if counts is None:
        return 0
    s = case.shape
    nk, nr = counts[case.mode]
    item = _ITEMSIZE[case.dtype]
    linear = 0
    if provider == "reference":
        item = 8 if case.dtype == "fp64" else 4
        linear = (2 if case.mode == FWD_BWD else 1) * s.B * s.H * s.D * (2 * s.Lk + s.R) * item
    return s.B * s.H * s.Lq * (nk * s.Lk + nr * s.R) * item + linear


def memory_skip_reason(case: Case, provider: str, available: Optional[int] = None
                       ) -> Optional[str]:
    """Why ``provider`` is not run on ``case`` (its dense tensors would not fit), or None."""
    need = dense_bytes(case, provider)
    if not need:
        return None
    avail = mem_available_bytes() if available is None else available
    if avail is None or need <= MEMORY_HEADROOM * avail:
        return None
    s = case.shape
    return (f"does not fit: its dense [B, H, Lq, Lk] / [B, H, Lq, R] tensors ({s.B}x{s.H}x"
            f"{s.Lq}x{s.Lk} / R={s.R}) need about {need / GiB:.1f} GiB at the peak of one "
            f"{case.mode}; {avail / GiB:.1f} GiB available")


# ---------------------------------------------------------------------------------------------
# The targets

# (group, mode, baseline, kind, bound): "speedup" = baseline time / cpu_fused time >= bound;
# "slowdown" = the time ratio cpu_fused time / baseline time <= bound. Against plain SDPA
# (issue #41): forward <= 1.5x, forward + backward <= 1.6x, in every dtype timed.
TARGETS = (
    ("cpu_conformer", FWD, "sdpa_plain", "slowdown", 1.5),
    ("cpu_conformer", FWD, "reference", "speedup", 5.0),
    ("cpu_conformer", FWD, "nemo_eager", "speedup", 5.0),
    ("cpu_conformer", FWD, "sdpa_bias", "speedup", 4.0),
    ("cpu_conformer", FWD_BWD, "reference", "speedup", 4.0),
    ("cpu_conformer", FWD_BWD, "sdpa_plain", "slowdown", 1.6),
    ("cpu_txl", FWD, "reference", "speedup", 2.0),
)
OURS = "cpu_fused"


def _ms(rec: dict) -> str:
    return f"{rec['time_s'] * 1e3:.1f} ms x{rec.get('reps', 0)}" if rec.get("time_s") else ""


def target_checks(records: List[dict]) -> List[dict]:
    """One check per (case, target): ``row`` (case, dtype, mode, cpu_fused's median, the
    baseline, the baseline's median), ``base``, ``kind``, ``bound``, ``target`` (the target as
    text), and ``value`` (the measured speed-up or time ratio; None with ``why`` when a side
    did not run)."""
    by_case: Dict[str, Dict[str, dict]] = {}
    for rec in records:
        if rec.get("kind") == "cpu_attention":
            by_case.setdefault(rec["key"], {})[rec["provider"]] = rec
    checks = []
    for recs in by_case.values():
        ours = recs.get(OURS)
        if ours is None:
            continue
        for group, mode, base, kind, bound in TARGETS:
            if ours["group"] != group or ours["mode"] != mode:
                continue
            other = recs.get(base)
            check = dict(row=[f"{ours['group']} {ours['label']}", ours["dtype"], mode,
                              _ms(ours), base, _ms(other) if other else ""],
                         base=base, kind=kind, bound=bound, value=None, why="",
                         target=(f"speed-up >= {bound:g}x" if kind == "speedup"
                                 else f"time ratio <= {bound:g}x"))
            if ours.get("status") != "ok" or not ours.get("time_s"):
                check["why"] = f"cpu_fused {ours.get('status')}: {ours.get('reason', '')[:120]}"
            elif other is None or other.get("status") != "ok" or not other.get("time_s"):
                check["why"] = f"{base} " + ("not run" if other is None else
                                             f"{other.get('status')}: "
                                             f"{other.get('reason', '')[:160]}")
            elif kind == "speedup":
                check["value"] = other["time_s"] / ours["time_s"]
            else:
                check["value"] = ours["time_s"] / other["time_s"]
            checks.append(check)
    return checks


def _shown(kind: str, value: float) -> str:
    return f"speed-up {value:.2f}x" if kind == "speedup" else f"time ratio {value:.2f}x"


def _verdict(kind: str, value: float, bound: float) -> str:
    return "met" if (value >= bound if kind == "speedup" else value <= bound) else "NOT met"


def target_rows(records: List[dict]) -> List[List[str]]:
    """One row per (case, target): case, dtype, mode, cpu_fused's median, the baseline, the
    baseline's median, the measured ratio, the target, and whether it is met (or why it could
    not be measured)."""
    rows = []
    for c in target_checks(records):
        if c["value"] is None:
            rows.append(c["row"] + ["", c["target"], c["why"]])
        else:
            rows.append(c["row"] + [_shown(c["kind"], c["value"]), c["target"],
                                    _verdict(c["kind"], c["value"], c["bound"])])
    return rows


def median_rows(runs: List[List[dict]]) -> List[List[str]]:
    """The targets over several runs (each a list of records, e.g. one per fresh process): one
    row per (case, target) with every run's ratio, their median, the target, and whether the
    median meets it (runs where a side did not run are left out; where none measured it, why
    the first run could not)."""
    first: Dict[Tuple[str, ...], dict] = {}  # each target as first seen, in that order
    for records in runs:
        for c in target_checks(records):
            key = (c["row"][0], c["row"][1], c["row"][2], c["base"])
            first.setdefault(key, dict(c, values=[]))
            if c["value"] is not None:
                first[key]["values"].append(c["value"])
    rows = []
    for key, c in first.items():
        vals = c["values"]
        if not vals:
            rows.append(list(key) + ["", "", c["target"], c["why"]])
            continue
        med = statistics.median(vals)
        rows.append(list(key) + [", ".join(f"{v:.2f}" for v in vals), _shown(c["kind"], med),
                                 c["target"], _verdict(c["kind"], med, c["bound"])])
    return rows


# issue #41: the fused kernel's speed-up on all cores over one thread, at T >= 4,096
SCALING_MIN_T, SCALING_BOUND = 4096, 1.8


def scaling_values(records: List[dict]) -> Dict[Tuple[str, int], float]:
    """cpu_fused's time at one thread / its time at the most threads timed, per Conformer case
    (series without the thread count, T) from ``SCALING_MIN_T`` on; the thread count goes in
    the key's text."""
    by: Dict[Tuple[str, int], Dict[int, float]] = {}
    for r in records:
        if (r.get("kind") == "cpu_attention" and r.get("provider") == OURS
                and r.get("group") == "cpu_conformer" and r.get("time_s")
                and r.get("seqlen", 0) >= SCALING_MIN_T):
            m = re.search(r" (\d+)thr ", r["series"])
            if m:
                key = (re.sub(r" \d+thr ", " ", r["series"]), r["seqlen"])
                by.setdefault(key, {})[int(m.group(1))] = r["time_s"]
    out = {}
    for (series, T), times in by.items():
        n = max(times)
        if 1 in times and n > 1:
            out[(f"{series} T{T}, {n} threads vs 1", T)] = times[1] / times[n]
    return out


def scaling_rows(runs: List[List[dict]]) -> List[List[str]]:
    """One row per case of :func:`scaling_values`: each run's speed-up, their median, the
    target and whether the median meets it."""
    vals: Dict[Tuple[str, int], List[float]] = {}
    for records in runs:
        for key, v in scaling_values(records).items():
            vals.setdefault(key, []).append(v)
    rows = []
    for (case, _T), vs in vals.items():
        med = statistics.median(vs)
        rows.append([case, ", ".join(f"{v:.2f}" for v in vs), f"speed-up {med:.2f}x",
                     f"speed-up >= {SCALING_BOUND:g}x",
                     "met" if med >= SCALING_BOUND else "NOT met"])
    return rows


def _scaling_lines(runs: List[List[dict]]) -> List[str]:
    rows = scaling_rows(runs)
    if not rows:
        return []
    return [""] + _table(["all cores over one thread (cpu_fused)", "each run", "median",
                          "target", ""], ["---", "---", "---:", "---", "---"], rows)


def summary(records: List[dict]) -> str:
    """Markdown: the machine, what ``cpu_fused`` ran, bf16, then the target table."""
    from .providers import cpu_fused_backend

    lines = [f"- {ln}" for ln in machine_lines()]
    backend = cpu_fused_backend()
    if backend != "cpu":
        lines.append(f"- **cpu_fused ran rel_attention(backend={backend!r}), not the CPU kernel "
                     f"(TXL_BENCH_CPU_BACKEND): a pipeline check, not a result.**")
    lines.append(f"- {bf16_wanted()[1]}")
    lines.append("")
    head = ["case", "dtype", "mode", "cpu_fused (median)", "baseline", "baseline (median)",
            "measured", "target", ""]
    lines += _table(head, ["---"] * 3 + ["---:", "---", "---:", "---:", "---", "---"],
                    target_rows(records))
    lines += _scaling_lines([records])
    return "\n".join(lines) + "\n"


def _table(head: List[str], align: List[str], rows: List[List[str]]) -> List[str]:
    """Markdown table lines ("|" inside a cell becomes "/")."""
    return (["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
            + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows])


def median_summary(runs: List[List[dict]]) -> str:
    """Markdown: the machine, then :func:`median_rows` as a table."""
    lines = [f"- {ln}" for ln in machine_lines()]
    lines.append(f"- {len(runs)} runs, each in a fresh process; each target is judged by the "
                 f"median of the runs' ratios")
    lines.append("")
    head = ["case", "dtype", "mode", "baseline", "each run", "median", "target", ""]
    lines += _table(head, ["---"] * 5 + ["---:", "---", "---"], median_rows(runs))
    lines += _scaling_lines(runs)
    return "\n".join(lines) + "\n"
