"""Ahead-of-time compile check of the fused Triton kernels for NVIDIA targets, without a GPU.

    python -m tools.aot_check [--quick] [--json PATH] [--only REGEX] [--jobs N]
                           [--list] [--strict] [--target sm_80,sm_89,...|all]
                           [--defaults] [--dtypes bf16,...] [--head-dims 64,...]
                           [--spill-budget]

Targets (``--target``, default sm_90): any compute capability >= 8.0; ``all`` is one per
config family (sm_80, sm_89, sm_90, sm_100, sm_120). For each target the launchers run under
``txl_kernels._arch.compile_target``, so they pick that target's configs (the per-family tables
of rel_attn_fwd / rel_attn_bwd) and load path (TMA descriptors on sm_90 and newer, pointer
loads before), and each compile is checked against that target's shared-memory limit
(``txl_kernels._arch.ARCHS``). The limits below that name sm_90 are those of the default
target. ``--defaults`` compiles only the configs launched without an autotuner (the defaults
of TXL_KERNELS_AUTOTUNE=0 and the untuned kernels); ``--spill-budget`` fails the run when such
a config spills more than ``SPILL_BUDGET`` at bf16, D 64 / 128 (forward and decode 0 B,
backward 64 B per kernel). The per-target CI command and the table in BENCHMARKS.md:
``python -m tools.aot_check --quick --defaults --dtypes bf16 --target sm_80,sm_89,sm_90,sm_100``.

A developer tool of the source tree (it uses private Triton APIs: ``create_function_from_signature``,
``JITFunction._pack_args``, ``Autotuner.nargs``, and swaps module globals for recorders while a
launcher runs); it is not installed with the package. Run it from the repository root.

What it checks. Every ``@triton.jit`` kernel of ``rel_attn_fwd.py`` and ``rel_attn_bwd.py``
(entry points, i.e. jit functions that return nothing; the ``@triton.jit`` helpers they call
are compiled inside them) is compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` through the whole pipeline: Triton IR, TritonGPU IR with the
Hopper layouts (layout conversions, the ``tl.gather`` lowering -- cf. triton-lang/triton#5836 --,
wgmma selection, software pipelining), LLVM IR, PTX, and ``ptxas`` (bundled with Triton) to a
cubin, with register allocation. The interpreter tests exercise none of this. A case FAILs
when any stage raises, or when the kernel needs more shared memory than an sm_90 block can
have (227 KiB; that error would otherwise only appear at launch time). An autotune config
over that limit is reported as OOR instead: Triton's autotuner skips configs that raise
OutOfResources, so it only fails the run when no config of that launch fits (or with
``--strict``); it is listed as a config to prune.

Which cases. The signatures are not written by hand: the real launchers (``rel_attn_fwd``,
``rel_attn_bwd``) are called on ``meta`` tensors (shapes and strides, no data) with the
kernel objects temporarily replaced by recorders, so the checker sees exactly the arguments
and meta-parameters a launch passes (the ``uint8`` mask views, the placeholder pointers passed
when a mask is absent, the stride values). They are then specialised with Triton's own launch
binder, as a GPU launch would: pointer element types, ``i32`` / ``i64`` ints, the ints equal to 1
that become constants, the 16-divisibility hints of pointers and ints. For autotuned kernels
(``triton.autotune`` / ``triton.heuristics`` are unwrapped) each config that the module's
pruning keeps for that launch is compiled; with ``TXL_KERNELS_AUTOTUNE=0`` the forward's
default config is added. The grid: dtypes fp16, bf16, fp32 with TF32 and with IEEE products
(``torch.get_float32_matmul_precision``), head dims 64, 128, 256 and 41 (padded to
BLOCK_D 64, strides not divisible by 16), and the flag sets: all off (no window, no masks, one
split, deterministic dr), all on (causal + left window, key padding mask, dense mask with its
on-device band descriptor, split-K, both the deterministic dr and the atomic dr), and all on
with the dense mask but no band descriptor, and an int8 memory before the segment (the
forward's and the decode kernel's 8-bit variants). Identical compiles are done once.
``--quick`` (CI): flags all on and the int8 memory, head dims 64 and 128, for every dtype the largest offered
config of each kernel (largest tile, then most warps and stages) and every fixed config
(launched without an autotuner to fall back on, e.g. the forward's default config).

Each compile prints the kernel, the case and config, OK / FAIL, registers per thread, spill
stores / loads (bytes, from ptxas' report), shared memory, the count of Hopper ``wgmma``
and of ``mma.sync`` tensor-core instructions in the PTX, an estimate of resident blocks per SM
(from registers, shared memory and warps) and the compile time, then a per-kernel summary.
Exit status 1 if any compile fails, a launcher cannot be driven, or a kernel of either module
is never launched by any case. ``--json PATH`` writes every result; ``--list`` prints the
cases without compiling; ``--only REGEX`` keeps the kernels whose name matches. Compiles run
in a fresh Triton cache (so each really compiles) in ``--jobs`` processes (default 2).

What it cannot check. Nothing runs: numerical results, races, out-of-bounds accesses,
deadlocks and speed need a GPU (the GPU tests and the benchmark suite). Register and spill
figures are ptxas' static allocation; occupancy is an estimate. The compiles use this Triton
version's and this ptxas's code generation; a different Triton may lay the kernels out
differently. Launch-time specialisation on pointer alignment is assumed to be the usual
16-byte-aligned torch allocation.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

KERNEL_MODULES = ("txl_kernels.ops.rel_attn_fwd", "txl_kernels.ops.rel_attn_bwd",
                  "txl_kernels.ops.rel_attn_decode")

# Per-target resource limits: txl_kernels._arch.ARCHS (shared memory per block and per SM,
# warps and blocks per SM). Shared memory the driver reserves per resident block:
SHARED_RESERVED_PER_BLOCK = 1024
DEFAULT_TARGET = 90
# --target all: one capability per config family (sm_86 shares sm_89's tables and limits).
ALL_TARGETS = (80, 89, 90, 100, 120)

DTYPE_CASES = ("fp16", "bf16", "fp32-tf32", "fp32-ieee")
HEAD_DIMS_FULL = (64, 128, 256, 41)
HEAD_DIMS_QUICK = (64, 128)
# "off": no window, no masks, one split, deterministic dr. "on": everything on (causal + left
# window, key padding, dense mask with its on-device band descriptor, split-K, deterministic
# and atomic dr, attention dropout). "on-noband": the same, the dense mask without a band
# descriptor and without dropout. "on-mem8": an int8 memory (8-bit keys / values + scales)
# before the current segment, causal + left window, key padding, split-K: the forward's and
# the decode's QUANT_MEM variants (the backward has none). "on-nomask": "on" without the dense
# mask, forward only: the launch most training runs make, whose forward defaults differ from
# the dense mask's (sm_90: 128-row tiles, and at D 128 the operand workspaces, OP_TILES).
FLAG_SETS = ("off", "on", "on-noband", "on-mem8", "on-nomask")
QUICK_FLAG_SETS = ("on", "on-mem8", "on-nomask")
# Kernels launched on some targets only (elsewhere "not launched" is expected, not a failure):
# kernel -> the targets whose launches take it.
TARGET_KERNELS = {"_rel_attn_fwd_operands_kernel": (90,)}


# ----------------------------------------------------------------------------------------------
# Compiling one kernel
# ----------------------------------------------------------------------------------------------


def _target(capability: int = DEFAULT_TARGET):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", int(capability), 32)


def _arch(capability: int):
    from txl_kernels._arch import arch_info
    return arch_info(capability)


def parse_targets(text: str) -> Tuple[int, ...]:
    """``"sm_80,sm_89"`` / ``"80,90"`` / ``"all"`` -> capabilities (each must be >= 80)."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        caps = ALL_TARGETS if part == "all" else (int(part.removeprefix("sm_").removeprefix(
            "sm")),)
        for cap in caps:
            _arch(cap)  # ValueError below sm_80
            if cap not in out:
                out.append(cap)
    if not out:
        raise ValueError(f"no target in {text!r}")
    return tuple(out)


_PTXAS_PATTERNS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spill": re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def _parse_ptxas_log(log: str, name: str) -> Dict[str, Optional[int]]:
    """Registers / spills / stack of entry function ``name`` from a ``ptxas -v`` log."""
    start = log.find(f"Compiling entry function '{name}'")
    part = log[start:] if start >= 0 else log
    out: Dict[str, Optional[int]] = {"regs": None, "spill_stores": None, "spill_loads": None,
                                     "stack": None}
    m = _PTXAS_PATTERNS["regs"].search(part)
    if m:
        out["regs"] = int(m.group(1))
    m = _PTXAS_PATTERNS["spill"].search(part)
    if m:
        out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = _PTXAS_PATTERNS["stack"].search(part)
    if m:
        out["stack"] = int(m.group(1))
    return out


def _blocks_per_sm(regs: Optional[int], shared: Optional[int], num_warps: int,
                   target: int = DEFAULT_TARGET) -> Optional[int]:
    """Estimated resident blocks per SM of ``target`` (registers allocated per warp in units
    of 256)."""
    if regs is None or shared is None:
        return None
    a = _arch(target)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (a.regs_per_sm // regs_per_warp) // num_warps
    by_smem = a.shared_per_sm // (shared + SHARED_RESERVED_PER_BLOCK)
    by_warps = a.max_warps_per_sm // num_warps
    return int(min(by_regs, by_smem, by_warps, a.max_blocks_per_sm))


def _first_line(text: str, limit: int = 400) -> str:
    """The informative part of a compiler error: its last non-empty lines, shortened."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    msg = " | ".join(lines[-3:])
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def compile_kernel(fn, signature: Dict[str, str], constexprs: Optional[Dict] = None,
                   attrs: Optional[Dict] = None, num_warps: int = 4, num_stages: int = 2,
                   extra_options: Optional[Dict[str, Any]] = None,
                   target: int = DEFAULT_TARGET) -> Dict[str, Any]:
    """Compile ``fn`` (a ``triton.jit`` JITFunction) for sm_``target`` and describe the result.

    ``signature`` maps every argument name to a Triton type string (``"*fp16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``); ``constexprs`` maps names or index paths to values; ``attrs``
    are the launch specialisation hints (``{(i,): [["tt.divisibility", 16]]}``). Never raises
    for a compile problem: returns ``status`` "OK" or "FAIL" with ``error``.
    """
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    res: Dict[str, Any] = {"kernel": getattr(fn, "__name__", str(fn)), "status": "FAIL",
                           "error": None, "regs": None, "spill_stores": None,
                           "spill_loads": None, "stack": None, "shared": None, "wgmma": None,
                           "mma_sync": None, "tcgen05": None, "tma": None,
                           "blocks_per_sm": None,
                           "seconds": None, "num_warps": num_warps, "num_stages": num_stages,
                           "target": f"sm_{target}"}
    if type(fn).__name__ != "JITFunction":
        res["error"] = (f"{res['kernel']} is a {type(fn).__name__}, not a compiled-mode "
                        "JITFunction (is TRITON_INTERPRET set?)")
        return res
    options = dict(num_warps=num_warps, num_stages=num_stages)
    options.update(extra_options or {})
    log = io.StringIO()
    old_dump = knobs.nvidia.dump_ptxas_log
    t0 = time.perf_counter()
    try:
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v report, printed by Triton: captured
        with contextlib.redirect_stdout(log):
            src = ASTSource(fn, signature, constexprs, attrs)
            kernel = triton.compile(src, target=_target(target), options=options)
    except Exception as exc:  # any stage: frontend, MLIR passes, LLVM, ptxas
        res["seconds"] = round(time.perf_counter() - t0, 2)
        res["error"] = f"{type(exc).__name__}: {_first_line(str(exc))}"
        return res
    finally:
        knobs.nvidia.dump_ptxas_log = old_dump
    res["seconds"] = round(time.perf_counter() - t0, 2)
    md = kernel.metadata
    res["shared"] = int(getattr(md, "shared", 0) or 0)
    ptx = kernel.asm.get("ptx", "")
    if isinstance(ptx, bytes):
        ptx = ptx.decode(errors="replace")
    ttir = kernel.asm.get("ttir", "")
    res["has_dot"] = "tt.dot" in (ttir if isinstance(ttir, str) else "")
    res["wgmma"] = len(re.findall(r"\bwgmma\.mma_async", ptx))
    res["mma_sync"] = len(re.findall(r"\bmma\.sync", ptx))
    res["tcgen05"] = len(re.findall(r"\btcgen05\.mma", ptx))
    res["tma"] = len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx))  # TMA tile loads
    res.update(_parse_ptxas_log(log.getvalue(), getattr(md, "name", res["kernel"])))
    if res["regs"] is None:  # cache hit (no ptxas run): ask cuobjdump for the cubin's usage
        res.update(_cuobjdump_usage(kernel.asm.get("cubin")))
    res["blocks_per_sm"] = _blocks_per_sm(res["regs"], res["shared"], num_warps, target)
    limit = _arch(target).max_shared
    if res["shared"] > limit:
        res["oor"] = True
        res["error"] = (f"needs {res['shared']} bytes of shared memory, more than the "
                        f"{limit} an sm_{target} block can have (the launch "
                        "would fail with OutOfResources)")
        return res
    res["status"] = "OK"
    return res


def _cuobjdump_usage(cubin: Optional[bytes]) -> Dict[str, Optional[int]]:
    out: Dict[str, Optional[int]] = {}
    if not cubin:
        return out
    try:
        from triton import knobs
        tool = knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
            path = f.name
        try:
            text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                                  timeout=60).stdout
        finally:
            os.unlink(path)
    except Exception:
        return out
    m = re.search(r"REG:(\d+)", text)
    if m:
        out["regs"] = int(m.group(1))
    m = re.search(r"STACK:(\d+)", text)
    if m:
        out["stack"] = int(m.group(1))
    return out


# ----------------------------------------------------------------------------------------------
# Kernel discovery
# ----------------------------------------------------------------------------------------------


def _is_jit_function(obj) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "fn")


def _returns_value(fn) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Return) and node.value is not None
               for node in ast.walk(tree))


def entry_kernels(module) -> Dict[str, Any]:
    """The ``@triton.jit`` entry points defined in ``module``, by name: jit functions named
    ``*_kernel`` (the project's naming chain) that return nothing. Helpers are inlined into
    them, including those that return nothing (e.g. a helper that only stores or adds
    atomically)."""
    out = {}
    for name, obj in vars(module).items():
        if _is_jit_function(obj) and getattr(obj.fn, "__module__", None) == module.__name__ \
                and obj.fn.__name__.endswith("_kernel") and not _returns_value(obj):
            out[obj.fn.__name__] = obj
    return out


def _unwrap(obj):
    """Innermost JITFunction of Autotuner / Heuristics wrappers, and the wrapper chain."""
    chain = []
    while not _is_jit_function(obj):
        chain.append(obj)
        obj = obj.fn
    return obj, chain


# ----------------------------------------------------------------------------------------------
# Capturing launches from the real launchers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One launcher call: dtype (and fp32 matmul precision), head dim, flag set."""
    dtype: str   # one of DTYPE_CASES
    head_dim: int
    flags: str   # one of FLAG_SETS

    @property
    def label(self) -> str:
        return f"{self.dtype} D{self.head_dim} flags-{self.flags}"


@dataclasses.dataclass
class Launch:
    obj: Any            # what the launcher indexed: JITFunction, Autotuner or Heuristics
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a kernel object during a launcher call: ``kernel[grid](*args, **kw)``
    records the call instead of launching; other attributes come from the real object."""

    def __init__(self, obj, log: List[Launch]):
        self._obj = obj
        self._log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._log.append(Launch(self._obj, args, dict(kwargs)))
        return launch

    def run(self, *args, grid=None, warmup=False, **kwargs):
        self._log.append(Launch(self._obj, args, dict(kwargs)))

    def __getattr__(self, name):
        return getattr(self._obj, name)


@contextlib.contextmanager
def _recording(module, log: List[Launch]):
    """Replace the module's kernel objects (entry JITFunctions and the autotune / heuristics
    wrappers around them) by recorders for the duration of the block."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    saved = {}
    for name, obj in list(vars(module).items()):
        if isinstance(obj, (Autotuner, Heuristics)) or (
                _is_jit_function(obj) and not _returns_value(obj)):
            saved[name] = obj
            setattr(module, name, _Recorder(obj, log))
    try:
        yield
    finally:
        for name, obj in saved.items():
            setattr(module, name, obj)


@contextlib.contextmanager
def _environment(dtype_case: str, autotune: bool):
    import torch
    old_prec = torch.get_float32_matmul_precision()
    old_env = os.environ.get("TXL_KERNELS_AUTOTUNE")
    try:
        if dtype_case == "fp32-ieee":
            torch.set_float32_matmul_precision("highest")
        elif dtype_case == "fp32-tf32":
            torch.set_float32_matmul_precision("high")
        if autotune:
            os.environ.pop("TXL_KERNELS_AUTOTUNE", None)
        else:
            os.environ["TXL_KERNELS_AUTOTUNE"] = "0"
        yield
    finally:
        torch.set_float32_matmul_precision(old_prec)
        if old_env is None:
            os.environ.pop("TXL_KERNELS_AUTOTUNE", None)
        else:
            os.environ["TXL_KERNELS_AUTOTUNE"] = old_env


def _torch_dtype(dtype_case: str):
    import torch
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype_case, torch.float32)


def _shapes(sc: Scenario) -> dict:
    """Launch shapes on meta tensors. Flags off: a square training segment whose sizes are
    multiples of 16. Flags on: odd lengths with a memory (Lk > Lq), a causal + left window,
    key padding, a dense mask (with its band descriptor unless "on-noband"), 4 key splits,
    deterministic and atomic dr, and the deterministic backward once more with an r too long
    for the atomics' int32 offsets (``long_r``: on the families whose backward takes dq
    and dr by atomics, the only way to the dq and dr kernels in fp16 / bf16); attention
    dropout with "on" only, so the full set also compiles the masked kernels without dropout
    ("on-noband"). "on-mem8" and "on-nomask": the same window, padding and splits with an int8
    memory, or with dropout and no dense mask; forward (and decode) launches only."""
    if sc.flags == "off":
        return dict(B=2, H=8, Lq=1024, Lk=1024, R=1024, wl=-1, wr=-1, kpm=False, mask=False,
                    band=False, splits=1, deterministic=(True,))
    on = dict(B=2, H=8, Lq=300, Lk=1000, R=1000, wl=256, wr=0, kpm=True, splits=4)
    if sc.flags == "on-mem8":  # Lk = 700 memory rows (int8) + 300 current rows
        return dict(on, mask=False, band=False, deterministic=(), mem8=700)
    if sc.flags == "on-nomask":  # (no backward runs: deterministic=())
        return dict(on, mask=False, band=False, deterministic=(), dropout=0.1)
    return dict(on, mask=True, band=sc.flags == "on", deterministic=(True, False),
                dropout=0.1 if sc.flags == "on" else 0.0, long_r=True)


def _meta_inputs(sc: Scenario, s: dict):
    import torch
    dt = _torch_dtype(sc.dtype)
    B, H, Lq, Lk, R, D = s["B"], s["H"], s["Lq"], s["Lk"], s["R"], sc.head_dim

    def t(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, device="meta")

    kpm = t(B, Lk, dtype=torch.bool) if s["kpm"] else None
    mask = t(B, H, Lq, Lk, dtype=torch.bool) if s["mask"] else None
    band = t(3, dtype=torch.int32) if s["band"] else None  # functional.mask_to_band's output
    Lc = Lk - s.get("mem8", 0)  # the keys / values passed as k / v (after the memory)
    return (t(B, Lq, H, D), t(B, Lc, H, D), t(B, Lc, H, D), t(R, H, D), t(H, D), t(H, D),
            kpm, mask, band)


def _memory(sc: Scenario, s: dict, rows: int):
    """An int8 QuantizedKV of ``rows`` memory rows on the meta device."""
    import torch
    from txl_kernels.quant import QuantizedKV
    B, H, D = s["B"], s["H"], sc.head_dim
    data = torch.empty(B, rows, H, D, dtype=torch.int8, device="meta")
    scale = torch.empty(B, rows, H, dtype=torch.float32, device="meta")
    return QuantizedKV(data, scale, torch.empty_like(data), torch.empty_like(scale))


def _dropout_kwargs(s: dict) -> dict:
    import torch
    if not s.get("dropout"):
        return {}
    return {"dropout_p": s["dropout"],
            "dropout_seed": torch.empty(2, dtype=torch.int64, device="meta")}


def _drive_fwd(module, sc: Scenario) -> None:
    s = _shapes(sc)
    q, k, v, r, u, vb, kpm, mask, band = _meta_inputs(sc, s)
    extra = {} if band is None else {"attn_mask_band": band}
    extra.update(_dropout_kwargs(s))
    if s.get("mem8"):
        extra["memory"] = _memory(sc, s, s["mem8"])
    module.rel_attn_fwd(q, k, v, r, u, vb, sc.head_dim ** -0.5, s["wl"], s["wr"], kpm, mask,
                        num_splits=s["splits"], **extra)


def _drive_bwd(module, sc: Scenario) -> None:
    import torch
    s = _shapes(sc)
    q, k, v, r, u, vb, kpm, mask, band = _meta_inputs(sc, s)
    extra = {} if band is None else {"attn_mask_band": band}
    extra.update(_dropout_kwargs(s))
    out = torch.empty_like(q)
    do = torch.empty_like(q)
    lse = torch.empty(s["B"], s["H"], s["Lq"], dtype=torch.float32, device="meta")
    runs = [(det, r) for det in s["deterministic"]]
    if s.get("long_r"):
        H, D = r.shape[1:]
        runs.append((True, torch.empty(2 ** 31 // (H * D), H, D, dtype=r.dtype, device="meta")))
    for det, r_run in runs:
        module.rel_attn_bwd(do, q, k, v, r_run, u, vb, out, lse, sc.head_dim ** -0.5, s["wl"],
                            s["wr"], key_padding_mask=kpm, attn_mask=mask, deterministic=det,
                            **extra)


def _drive_decode(module, sc: Scenario) -> None:
    """One query row against Lk keys (flags "on": 16-bit keys; "on-mem8": an int8 memory of
    Lk - 1 rows, then the current row), causal with a left window, 4 splits."""
    import torch
    if sc.flags not in ("on", "on-mem8"):
        return
    s = _shapes(sc)
    B, H, D, Lk = s["B"], s["H"], sc.head_dim, s["Lk"]
    dt = _torch_dtype(sc.dtype)

    def t(*shape):
        return torch.empty(*shape, dtype=dt, device="meta")
    mem = _memory(sc, s, Lk - 1) if sc.flags == "on-mem8" else None
    lc = 1 if mem is not None else Lk
    module.rel_attn_decode(t(B, 1, H, D), t(B, lc, H, D), t(B, lc, H, D), t(Lk, H, D),
                           t(H, D), t(H, D), D ** -0.5, window_left=s["wl"],
                           num_splits=s["splits"], memory=mem)


# Module -> how to call its launcher for a scenario (the only place that knows the launchers'
# signatures; the kernels' own signatures are taken from the recorded calls).
DRIVERS: Dict[str, Callable] = {
    "txl_kernels.ops.rel_attn_fwd": _drive_fwd,
    "txl_kernels.ops.rel_attn_bwd": _drive_bwd,
    "txl_kernels.ops.rel_attn_decode": _drive_decode,
}


@dataclasses.dataclass
class Job:
    module: str
    kernel: str
    signature: Dict[str, str]
    constexprs: Dict[Tuple[int, ...], Any]
    attrs: Dict[Tuple[int, ...], Any]
    num_warps: int
    num_stages: int
    extra_options: Dict[str, Any]
    config: str                      # meta-parameters that come from the config / launch
    cases: List[str] = dataclasses.field(default_factory=list)
    scenarios: List[Scenario] = dataclasses.field(default_factory=list)
    largest_key: Tuple = ()
    autotuned: bool = True           # False if some launch uses this config without a tuner
    sources: List[str] = dataclasses.field(default_factory=list)  # "autotune" / "fixed"
    groups: List[str] = dataclasses.field(default_factory=list)  # launches that offer it
    target: int = DEFAULT_TARGET     # compute capability compiled for

    def arg_name(self, path) -> str:
        """Argument name of a constexpr / attr index path."""
        names = list(self.signature)
        idx = path[0] if isinstance(path, tuple) else path
        return names[idx] if isinstance(idx, int) and idx < len(names) else str(idx)

    def key(self) -> str:
        return repr((self.target, self.module, self.kernel, sorted(self.signature.items()),
                     sorted((k, repr(v)) for k, v in self.constexprs.items()),
                     sorted((k, repr(v)) for k, v in self.attrs.items()),
                     self.num_warps, self.num_stages, sorted(self.extra_options.items())))


_CONFIG_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _specialise(backend, fn, args: tuple, kwargs: dict):
    """What ``fn[grid](*args, **kwargs)`` would compile: Triton's launch binder."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                          specialization, options)
    return options, signature, constexprs, attrs


def jobs_from_launch(backend, module_name: str, launch: Launch,
                     target: int = DEFAULT_TARGET) -> List[Job]:
    """Compile jobs for one recorded launch: one per config the autotuner would try."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    fn, chain = _unwrap(launch.obj)
    variants: List[Tuple[dict, str]] = [(dict(launch.kwargs), "")]
    for wrapper in chain:
        nxt = []
        for kw, cfg_label in variants:
            if isinstance(wrapper, Autotuner):
                wrapper.nargs = dict(zip(wrapper.arg_names, launch.args))
                try:
                    configs = (wrapper.prune_configs(kw) if len(wrapper.configs) > 1
                               else list(wrapper.configs))
                finally:
                    wrapper.nargs = None
                for cfg in configs:
                    nxt.append(({**kw, **cfg.all_kwargs()}, "autotune"))
            elif isinstance(wrapper, Heuristics):
                kw = dict(kw)
                named = {**dict(zip(wrapper.arg_names, launch.args)), **kw}
                for name, heur in wrapper.values.items():
                    kw[name] = heur(named)
                nxt.append((kw, cfg_label))
            else:
                raise TypeError(f"cannot unwrap {type(wrapper).__name__} around {fn.__name__}")
        variants = nxt

    defaults = backend.parse_options({}).__dict__
    jobs = []
    for kw, source in variants:
        options, signature, constexprs, attrs = _specialise(backend, fn, launch.args, kw)
        opts = options.__dict__
        extra = {k: v for k, v in opts.items()
                 if k not in ("num_warps", "num_stages", "debug") and k in kw
                 and v != defaults.get(k)}
        names = list(signature)
        meta_names = [n for n in names if n.startswith("BLOCK") and n in kw]
        cfg = " ".join(f"{n}={kw[n]}" for n in meta_names)
        cfg = f"{cfg} w{opts['num_warps']} s{opts['num_stages']}".strip()
        blocks = 1
        for n in meta_names:
            if n != "BLOCK_D" and isinstance(kw[n], int):
                blocks *= kw[n]
        jobs.append(Job(module_name, fn.__name__, dict(signature), dict(constexprs),
                        dict(attrs), int(opts["num_warps"]), int(opts["num_stages"]), extra,
                        cfg, largest_key=(blocks, opts["num_warps"], opts["num_stages"]),
                        autotuned=bool(source),
                        sources=["autotune" if source else "fixed"], target=target))
    return jobs


def collect_jobs(head_dims: Sequence[int] = HEAD_DIMS_FULL,
                 dtypes: Sequence[str] = DTYPE_CASES,
                 flag_sets: Sequence[str] = FLAG_SETS,
                 modules: Sequence[str] = KERNEL_MODULES,
                 target: int = DEFAULT_TARGET) -> Tuple[List[Job], Dict[str, List[str]],
                                                        List[str], Dict[str, List[str]]]:
    """All distinct compile jobs over the grid for sm_``target``, the entry kernels of each
    module, the errors met while driving the launchers (each one is a failure), and the launch
    groups (recorded launch -> keys of the jobs it offers: its autotune configs, or its one
    fixed config). The launchers run under ``txl_kernels._arch.compile_target(target)``, so
    they choose that arch's configs and its load path (TMA descriptors from sm_90 on)."""
    import importlib
    from triton.compiler import make_backend
    from txl_kernels._arch import compile_target
    backend = make_backend(_target(target))
    jobs: Dict[str, Job] = {}
    kernels: Dict[str, List[str]] = {}
    errors: List[str] = []
    groups: Dict[str, List[str]] = {}
    for mod_name in modules:
        module = importlib.import_module(mod_name)
        kernels[mod_name] = sorted(entry_kernels(module))
        drive = DRIVERS[mod_name]
        for dtype in dtypes:
            for d in head_dims:
                for flags in flag_sets:
                    sc = Scenario(dtype, d, flags)
                    for autotune in (True, False):
                        log: List[Launch] = []
                        try:
                            with _environment(dtype, autotune), _recording(module, log), \
                                    compile_target(target):
                                drive(module, sc)
                            for n, launch in enumerate(log):
                                gid = (f"sm_{target} {mod_name} {sc.label} autotune-"
                                       f"{'on' if autotune else 'off'} launch {n}")
                                for new in jobs_from_launch(backend, mod_name, launch,
                                                            target):
                                    job = jobs.setdefault(new.key(), new)
                                    job.autotuned = job.autotuned and new.autotuned
                                    for src in new.sources:
                                        if src not in job.sources:
                                            job.sources.append(src)
                                    job.groups.append(gid)
                                    groups.setdefault(gid, []).append(job.key())
                                    if sc.label not in job.cases:
                                        job.cases.append(sc.label)
                                        job.scenarios.append(sc)
                        except Exception as exc:
                            errors.append(f"{mod_name}: launcher failed for {sc.label} "
                                          f"on sm_{target} "
                                          f"(autotune={'on' if autotune else 'off'}): "
                                          f"{type(exc).__name__}: {_first_line(str(exc))}")
    out = list(jobs.values())
    _label_variants(out)
    for job in out:
        # "autotune": a config the autotuner tries; "fixed": launched as is (no fallback), e.g.
        # the forward's default config under TXL_KERNELS_AUTOTUNE=0
        if "autotune" in job.sources:
            job.config += f" ({' + '.join(sorted(job.sources))})"
    return out, kernels, errors, groups


def _label_variants(jobs: List[Job]) -> None:
    """Add to the config label the non-BLOCK constexprs that tell apart jobs of one kernel
    in one case (e.g. ATOMIC_DR=True / False): the case label alone does not show them."""
    groups: Dict[Tuple[str, str, str], List[Job]] = {}
    for job in jobs:
        for case in job.cases:
            groups.setdefault((job.module, job.kernel, case), []).append(job)
    varying: Dict[Tuple[str, str], set] = {}
    for (mod, kern, _), members in groups.items():
        values: Dict[str, set] = {}
        for job in members:
            for path, val in job.constexprs.items():
                name = job.arg_name(path)
                if not name.startswith("BLOCK"):
                    values.setdefault(name, set()).add(repr(val))
        names = {n for n, vals in values.items() if len(vals) > 1}
        varying.setdefault((mod, kern), set()).update(names)
    for job in jobs:
        names = varying.get((job.module, job.kernel), set())
        extra = [f"{job.arg_name(p)}={v}" for p, v in job.constexprs.items()
                 if job.arg_name(p) in names]
        if extra:
            job.config = f"{job.config} {' '.join(extra)}"


def quick_subset(jobs: List[Job]) -> List[Job]:
    """Per (kernel, dtype, head dim), in the flags-on cases: the largest config(s) (tile area,
    then warps, then stages) of each kernel variant (jobs differing in non-BLOCK constexprs,
    e.g. the deterministic and the atomic dr, are variants), and every fixed-config launch
    (no autotuner to fall back on: the forward's TXL_KERNELS_AUTOTUNE=0 default, the
    untuned kernels). A kernel only launched with flags off would keep its flags-off jobs."""
    groups: Dict[Tuple, List[Tuple[Job, Scenario]]] = {}
    for job in jobs:
        for sc in job.scenarios:
            groups.setdefault((job.target, job.module, job.kernel, sc.dtype, sc.head_dim,
                               sc.flags), []).append((job, sc))
    chosen: Dict[str, Job] = {}
    for (tgt, mod, kern, dtype, d, flags), members in groups.items():
        if flags not in QUICK_FLAG_SETS and (tgt, mod, kern, dtype, d, "on") in groups:
            continue
        by_variant: Dict[str, List[Job]] = {}
        for job, _ in members:
            variant = repr(sorted((k, repr(v)) for k, v in job.constexprs.items()
                                  if not job.arg_name(k).startswith("BLOCK")))
            by_variant.setdefault(variant, []).append(job)
        for vjobs in by_variant.values():
            top = max(j.largest_key for j in vjobs)
            for j in vjobs:
                if j.largest_key == top or not j.autotuned:
                    chosen[j.key()] = j
    return list(chosen.values())


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _compile_job(job: Job) -> Dict[str, Any]:
    import importlib
    module = importlib.import_module(job.module)
    fn = getattr(module, job.kernel, None)
    if fn is None or not _is_jit_function(fn):
        res = {"status": "FAIL", "error": f"{job.module}.{job.kernel} not found as a jit function"}
    else:
        res = compile_kernel(fn, job.signature, job.constexprs, job.attrs, job.num_warps,
                             job.num_stages, job.extra_options, job.target)
        if res["status"] == "FAIL" and res.get("oor") and job.autotuned:
            # Triton's autotuner skips a config that raises OutOfResources at launch: not a
            # failure by itself, as long as another config of the launch fits (checked in
            # the summary), but a config worth pruning.
            res["status"] = "OOR"
    res.update(module=job.module, kernel=job.kernel, config=job.config, cases=list(job.cases),
               key=job.key(), autotuned=job.autotuned, target=f"sm_{job.target}",
               default="fixed" in job.sources)
    return res


def format_result(res: Dict[str, Any]) -> str:
    def num(v, unit=""):
        return "-" if v is None else f"{v}{unit}"

    spills = ("-" if res.get("spill_stores") is None
              else f"{res['spill_stores']}/{res['spill_loads']}B")
    mma = res.get("mma_sync")
    if res.get("tcgen05"):  # sm_100's tensor-core instruction in the mma column
        mma = res["tcgen05"]
    head = (f"{res['status']:<4} {res.get('target', ''):<6} {res['kernel']:<32} "
            f"{res.get('config', ''):<44} "
            f"regs {num(res.get('regs')):>3}  spill {spills:>9}  "
            f"smem {num(res.get('shared')):>6}B  wgmma {num(res.get('wgmma')):>3}  "
            f"mma {num(mma):>3}  blk/SM {num(res.get('blocks_per_sm')):>2}  "
            f"{num(res.get('seconds'), 's'):>6}  [{'; '.join(res.get('cases', []))}]")
    if res["status"] != "OK":
        head += f"\n     error: {res.get('error')}"
    return head


# Spill budget of a default-config compile (bytes of spill stores or loads per kernel) in the
# budget cases (bf16, head dims 64 and 128): the forward and decode kernels none, the backward
# kernels 64 B. --spill-budget fails the run on a compile over it.
SPILL_BUDGET = {"txl_kernels.ops.rel_attn_fwd": 0, "txl_kernels.ops.rel_attn_bwd": 64,
                "txl_kernels.ops.rel_attn_decode": 0}
SPILL_BUDGET_DTYPES = ("bf16",)
SPILL_BUDGET_HEAD_DIMS = (64, 128)


# Where a target does not meet SPILL_BUDGET yet, the spill bytes (stores or loads, the larger)
# compiled at the current defaults bound it instead, so that a change spilling more still fails:
# (target, kernel, head dim) -> bytes (BENCHMARKS.md, "Per-architecture compile table").
# The forward's one entry: sm_90's D 128 8-bit-memory config (64 x 64, 8 warps) spills 4 / 8 B
# since its masked tiles load the memory's value rows with the key bias's NaN rows as 0 (a
# padded row's non-finite scale must not reach P V); every other forward config spills none.
SPILL_RECORDED: Dict[Tuple[str, str, int], int] = {
    ('sm_90', '_rel_attn_fwd_kernel', 128): 8,
    ('sm_90', '_rel_attn_bwd_dkdv_kernel', 64): 1136,
    ('sm_90', '_rel_attn_bwd_dkdv_kernel', 128): 3056,
    ('sm_90', '_rel_attn_bwd_dq_kernel', 64): 368,
    ('sm_90', '_rel_attn_bwd_dq_kernel', 128): 1260,
    ('sm_90', '_rel_attn_bwd_dr_kernel', 64): 128,
    ('sm_90', '_rel_attn_bwd_dr_kernel', 128): 476,
}


def _spill_bytes(res: Dict[str, Any]) -> int:
    return max(res.get("spill_stores") or 0, res.get("spill_loads") or 0)


def spill_budget_of(res: Dict[str, Any]) -> Optional[int]:
    """The spill budget (bytes) of a compile result, None when it has none (not a default
    config, not a budget case, or a module without a budget)."""
    if not res.get("default"):
        return None
    budget = SPILL_BUDGET.get(res.get("module"))
    if budget is None:
        return None
    dims = [int(c.split()[1][1:]) for c in res.get("cases", [])
            if c.split()[0] in SPILL_BUDGET_DTYPES
            and int(c.split()[1][1:]) in SPILL_BUDGET_HEAD_DIMS]
    if not dims:
        return None
    target = res.get("target", f"sm_{DEFAULT_TARGET}")
    return max([budget] + [SPILL_RECORDED.get((target, res.get("kernel"), d), 0)
                           for d in dims])


def over_spill_budget(res: Dict[str, Any]) -> bool:
    """A compiled default config of a budget case that spills more than its budget."""
    budget = spill_budget_of(res)
    return res.get("status") == "OK" and budget is not None and _spill_bytes(res) > budget


def _summary(results: List[Dict[str, Any]], kernels: Dict[str, List[str]],
             errors: List[str], groups: Dict[str, List[str]],
             strict: bool = False, spill_budget: bool = False) -> Tuple[List[str], bool]:
    """Per-target, per-kernel summary lines and the verdict. FAIL: a compile error, a
    fixed-config launch that cannot fit, an autotuned launch none of whose (all compiled)
    configs fit, a kernel never launched, a launcher error; with ``strict`` also any OOR
    config; with ``spill_budget`` a default config over SPILL_BUDGET (over_spill_budget)."""
    lines = []
    ok = not errors
    by_key = {r.get("key"): r for r in results}
    targets = sorted({r.get("target", f"sm_{DEFAULT_TARGET}") for r in results},
                     key=lambda t: int(t[3:])) or [f"sm_{DEFAULT_TARGET}"]
    for tname in targets:
        for mod, names in kernels.items():
            for name in names:
                rows = [r for r in results if r["module"] == mod and r["kernel"] == name
                        and r.get("target", f"sm_{DEFAULT_TARGET}") == tname]
                if not rows:
                    only = TARGET_KERNELS.get(name)
                    if only is not None and int(tname[3:]) not in only:
                        lines.append(f"OK   {tname} {name}: not launched on this target")
                        continue
                    lines.append(f"FAIL {tname} {name}: not launched by any case, not compiled")
                    ok = False
                    continue
                n_ok = sum(r["status"] == "OK" for r in rows)
                n_fail = sum(r["status"] == "FAIL" for r in rows)
                n_oor = sum(r["status"] == "OOR" for r in rows)
                good = [r for r in rows if r["status"] == "OK"]
                over = [r for r in good if over_spill_budget(r)] if spill_budget else []
                bad = n_fail > 0 or (strict and n_oor > 0) or bool(over)
                ok = ok and not bad
                regs = [r["regs"] for r in good if r.get("regs") is not None]
                spilling = [r for r in good if _spill_bytes(r) > 0]
                smem = [r["shared"] for r in good if r.get("shared") is not None]
                lines.append(
                    f"{'FAIL' if bad else 'OK  '} {tname} {name}: {n_ok}/{len(rows)} compiled OK"
                    + (f", {n_fail} FAILED" if n_fail else "")
                    + (f", {n_oor} over the {tname} shared-memory limit (OOR)" if n_oor else "")
                    + (f"; regs {min(regs)}..{max(regs)}" if regs else "")
                    + (f", smem <= {max(smem)}B" if smem else "")
                    + f", {len(spilling)} of {len(good)} spill"
                    + (f" (max {max(map(_spill_bytes, spilling))}B)" if spilling else ""))
                for r in over:
                    lines.append(f"FAIL {tname} {name} {r['config']}: default config spills "
                                 f"{_spill_bytes(r)}B, over its {spill_budget_of(r)}B budget "
                                 f"[{'; '.join(r.get('cases', []))}]")
    for gid, keys in sorted(groups.items()):
        members = [by_key.get(k) for k in keys]
        if not members or any(m is None for m in members):
            continue  # not all of this launch's configs were compiled (--quick / --only)
        if not any(m["status"] == "OK" for m in members) \
                and any(m["status"] == "OOR" for m in members):
            lines.append(f"FAIL {gid}: none of its {len(members)} autotune configs fits in "
                         "shared memory, the launch would fail")
            ok = False
    oor = [r for r in results if r["status"] == "OOR"]
    if oor:
        lines.append(f"note: {len(oor)} autotune config(s) exceed their target's shared-memory "
                     "limit; Triton's autotuner discards them at launch (wasted compile time: "
                     "prune them):")
        for r in oor:
            lines.append(f"    {r.get('target', '')} {r['kernel']} {r['config']} smem "
                         f"{r.get('shared')}B [{'; '.join(r.get('cases', []))}]")
    no_tc = [r for r in results if r["status"] == "OK" and not r.get("wgmma")
             and not r.get("mma_sync") and not r.get("tcgen05") and _expects_tensor_cores(r)]
    if no_tc:
        lines.append(f"note: {len(no_tc)} compile(s) with tl.dot and a tensor-core dtype have "
                     "no wgmma / mma / tcgen05 instruction:")
        for r in no_tc:
            lines.append(f"    {r.get('target', '')} {r['kernel']} {r['config']} "
                         f"[{'; '.join(r.get('cases', []))}]")
    for err in errors:
        lines.append(f"FAIL {err}")
    return lines, ok


def _expects_tensor_cores(res: Dict[str, Any]) -> bool:
    """A kernel that calls tl.dot, compiled for fp16 / bf16 / tf32 in every case."""
    if not res.get("has_dot"):
        return False
    return all(not c.startswith("fp32-ieee") for c in res.get("cases", []))


def run_checks(quick: bool = False, jobs: int = 2, only: Optional[str] = None,
               list_only: bool = False, strict: bool = False, out=None,
               targets: Sequence[int] = (DEFAULT_TARGET,), defaults_only: bool = False,
               dtypes: Optional[Sequence[str]] = None,
               head_dims: Optional[Sequence[int]] = None,
               spill_budget: bool = False) -> Tuple[int, Dict[str, Any]]:
    """Collect and compile the cases for each target; print one line per compile and a
    summary. ``defaults_only``: only the configs launched without an autotuner (the defaults
    of TXL_KERNELS_AUTOTUNE=0 and the untuned kernels); ``dtypes`` / ``head_dims`` narrow the
    grid. Returns (exit status, report dict)."""
    out = out or sys.stdout
    from txl_kernels._utils import interpreting
    if interpreting():
        raise RuntimeError("aot_check needs TRITON_INTERPRET unset before triton is imported "
                           "(run `python -m tools.aot_check`, which re-executes "
                           "itself without it)")
    t_start = time.perf_counter()
    head_dims = tuple(head_dims or (HEAD_DIMS_QUICK if quick else HEAD_DIMS_FULL))
    flag_sets = QUICK_FLAG_SETS if quick else FLAG_SETS
    dtypes = tuple(dtypes or DTYPE_CASES)
    all_jobs: List[Job] = []
    kernels: Dict[str, List[str]] = {}
    errors: List[str] = []
    groups: Dict[str, List[str]] = {}
    for target in targets:
        t_jobs, kernels, t_errors, t_groups = collect_jobs(
            head_dims=head_dims, dtypes=dtypes, flag_sets=flag_sets, target=target)
        all_jobs += t_jobs
        errors += t_errors
        groups.update(t_groups)
    selected = quick_subset(all_jobs) if quick else all_jobs
    if defaults_only:
        selected = [j for j in selected if "fixed" in j.sources]
    if only:
        rx = re.compile(only)
        selected = [j for j in selected if rx.search(j.kernel)]
        kernels = {m: [k for k in ks if rx.search(k)] for m, ks in kernels.items()}
    selected.sort(key=lambda j: (j.target, j.module, j.kernel, j.cases[0], j.config))
    tnames = ", ".join(f"sm_{t}" for t in targets)
    print(f"aot_check: {len(selected)} compiles for {tnames} "
          f"({'quick' if quick else 'full'} set{', default configs' if defaults_only else ''}; "
          f"{len(all_jobs)} distinct cases collected in {time.perf_counter() - t_start:.1f}s), "
          f"{jobs} worker(s)", file=out, flush=True)
    for err in errors:
        print(f"FAIL {err}", file=out, flush=True)
    if list_only:
        for j in selected:
            print(f"     sm_{j.target:<3} {j.kernel:<32} {j.config:<44} "
                  f"[{'; '.join(j.cases)}]", file=out)
        return (0 if not errors else 1), {"jobs": len(selected)}

    results: List[Dict[str, Any]] = []
    cache_dir = tempfile.mkdtemp(prefix="txl_aot_cache_")
    old_cache = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # fresh: every case really compiles
    try:
        if jobs <= 1:
            for job in selected:
                res = _compile_job(job)
                results.append(res)
                print(format_result(res), file=out, flush=True)
        else:
            import concurrent.futures as cf
            import multiprocessing as mp
            with cf.ProcessPoolExecutor(max_workers=jobs,
                                        mp_context=mp.get_context("spawn")) as pool:
                futures = {pool.submit(_compile_job, job): job for job in selected}
                for fut in cf.as_completed(futures):
                    job = futures[fut]
                    try:
                        res = fut.result()
                    except Exception as exc:  # a worker died (e.g. a compiler crash)
                        res = {"status": "FAIL", "module": job.module, "kernel": job.kernel,
                               "config": job.config, "cases": job.cases, "key": job.key(),
                               "error": f"worker failed: {type(exc).__name__}: "
                                        f"{_first_line(str(exc))}"}
                    results.append(res)
                    print(format_result(res), file=out, flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if old_cache is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old_cache

    results.sort(key=lambda r: (int(r.get("target", "sm_0")[3:]), r["module"], r["kernel"],
                                r.get("cases", [""])[0], r.get("config", "")))
    lines, ok = _summary(results, kernels, errors, groups, strict, spill_budget)
    wall = time.perf_counter() - t_start
    print("summary:", file=out)
    for ln in lines:
        print("  " + ln, file=out)
    n_ok = sum(r["status"] == "OK" for r in results)
    print(f"aot_check: {n_ok}/{len(results)} compiled OK for {tnames} in {wall:.1f}s -> "
          f"{'PASS' if ok else 'FAIL'}", file=out, flush=True)
    report = {"targets": [f"sm_{t}" for t in targets], "quick": quick,
              "defaults_only": defaults_only, "spill_budget": spill_budget, "ok": ok,
              "wall_seconds": round(wall, 1), "kernels": kernels, "errors": errors,
              "results": results}
    return (0 if ok else 1), report


def markdown_table(results: List[Dict[str, Any]]) -> str:
    """The compile results as a Markdown table: one row per kernel, case and non-BLOCK variant,
    one column per target with registers / spill bytes (stores) / shared memory (KiB) and the
    config (tile sizes, warps, stages)."""
    targets = sorted({r.get("target", f"sm_{DEFAULT_TARGET}") for r in results},
                     key=lambda t: int(t[3:]))
    cells: Dict[Tuple[str, str, str], Dict[str, str]] = {}
    for r in results:
        config = r.get("config", "")
        variant = " ".join(w for w in config.split() if "=" in w and not w.startswith("BLOCK"))
        tiles = " ".join(w.replace("BLOCK_", "").replace("BLOCK", "B") for w in config.split()
                         if w.startswith("BLOCK") and not w.startswith("BLOCK_D")
                         or w[:1] in "ws" and w[1:].isdigit())
        for case in r.get("cases", []):
            row = cells.setdefault((r["kernel"], case, variant), {})
            if r["status"] != "OK":
                row[r.get("target", "")] = f"{r['status']} ({tiles})"
            else:
                row[r.get("target", "")] = (f"{r.get('regs')} / {r.get('spill_stores')} / "
                                            f"{r.get('shared', 0) / 1024:.0f} ({tiles})")
    lines = ["| kernel | case | " + " | ".join(targets) + " |",
             "|---|---|" + "---|" * len(targets)]
    for (kernel, case, variant), row in sorted(cells.items()):
        label = f"{case}" + (f" {variant}" if variant else "")
        lines.append(f"| {kernel} | {label} | "
                     + " | ".join(row.get(t, "-") for t in targets) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "TRITON_INTERPRET" in os.environ:
        # @triton.jit gives interpreter functions when it is set: run again without it.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return subprocess.call([sys.executable, "-m", "tools.aot_check", *argv],
                               env=env, cwd=root)
    parser = argparse.ArgumentParser(
        prog="python -m tools.aot_check",
        description="Compile the fused Triton kernels for NVIDIA targets without a GPU.")
    parser.add_argument("--quick", action="store_true",
                        help="CI subset: flags all on, D 64 and 128, largest config per "
                             "kernel and dtype")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--only", metavar="REGEX", help="only kernels whose name matches")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    parser.add_argument("--list", action="store_true", help="list the cases, compile nothing")
    parser.add_argument("--strict", action="store_true",
                        help="also fail on autotune configs over the shared-memory limit")
    parser.add_argument("--target", default=f"sm_{DEFAULT_TARGET}", metavar="LIST",
                        help="comma-separated compute capabilities (sm_80,sm_89,...) or 'all' "
                             f"({', '.join(f'sm_{t}' for t in ALL_TARGETS)}); "
                             f"default sm_{DEFAULT_TARGET}")
    parser.add_argument("--defaults", action="store_true",
                        help="only the default configs (launches without an autotuner)")
    parser.add_argument("--dtypes", metavar="LIST",
                        help=f"comma-separated subset of {','.join(DTYPE_CASES)}")
    parser.add_argument("--head-dims", metavar="LIST", help="comma-separated head dims")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write a Markdown table (per kernel and case, per target: "
                             "registers / spill bytes / shared KiB (config))")
    parser.add_argument("--spill-budget", action="store_true",
                        help="fail when a default config spills over SPILL_BUDGET (bf16, "
                             "D 64 / 128: forward and decode 0 B, backward 64 B per kernel)")
    opts = parser.parse_args(argv)
    try:
        targets = parse_targets(opts.target)
    except ValueError as exc:
        parser.error(f"--target: {exc}")
    dtypes = opts.dtypes.split(",") if opts.dtypes else None
    if dtypes and not set(dtypes) <= set(DTYPE_CASES):
        parser.error(f"--dtypes: expected a subset of {DTYPE_CASES}, got {opts.dtypes!r}")
    head_dims = [int(d) for d in opts.head_dims.split(",")] if opts.head_dims else None
    rc, report = run_checks(quick=opts.quick, jobs=max(1, opts.jobs), only=opts.only,
                            list_only=opts.list, strict=opts.strict, targets=targets,
                            defaults_only=opts.defaults, dtypes=dtypes, head_dims=head_dims,
                            spill_budget=opts.spill_budget)
    if opts.json and not opts.list:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if opts.markdown and not opts.list:
        with open(opts.markdown, "w") as f:
            f.write(markdown_table(report["results"]) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
