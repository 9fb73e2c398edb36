"""Build report and CI compile check of the txl_kernels C++/CUDA extension (source tree only).

    python -m tools.build_check               # report, then build/load for this machine
    python -m tools.build_check --check-cuda  # CI: compile + link the CUDA sources, no GPU needed

``--check-cuda`` builds the CUDA variant with :func:`txl_kernels._build.compile_extension`
(for ``--arch``, default ``$TORCH_CUDA_ARCH_LIST``, else the visible GPUs, else the oldest
architecture torch was built for), imports it and compares it with the pure-torch
``update_mems`` on CPU (and CUDA when a GPU is visible). Exit status: 0 when it compiled,
linked and imported (or failed to import *only* for want of the NVIDIA driver library
libcuda.so) and the smoke test agreed; 1 when compiling or linking failed (the compiler output
is shown), the import failed for another reason (an undefined symbol: linking a shared library
does not catch those) or the smoke test disagreed; 2 when this environment cannot compile CUDA
at all (CPU-only torch, no toolkit, no ninja, no C++ compiler).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from typing import List, Optional, Tuple

import torch

from txl_kernels import _build
from txl_kernels.memory import _update_mems_torch


def _first_line(cmd: List[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(cannot run: {exc})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return next((ln for ln in lines if "release" in ln), lines[0] if lines else "")


def build_report() -> List[Tuple[str, str]]:
    """Environment and build report, one (key, value) per row, like DeepSpeed's ds_report.
    Compiles nothing."""
    dev = "none visible"
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        dev = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} " \
              f"(sm_{cap[0]}{cap[1]})"
    try:
        import triton
        triton_v = triton.__version__
    except Exception as exc:
        triton_v = f"not importable ({type(exc).__name__}: {exc})"
    ce = _build.cpp_extension()
    home = _build.cuda_home(ce)
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    cxx = os.environ.get("CXX", "c++")
    st = _build.extension_status()
    return [
        ("torch", f"{torch.__version__} at {os.path.dirname(torch.__file__)}"),
        ("torch CUDA runtime", torch.version.cuda or "none (not a CUDA build)"),
        ("CUDA device", dev),
        ("triton", triton_v),
        ("nvcc", f"{nvcc} ({_first_line([nvcc, '--version'])})" if nvcc else "not found"),
        ("CUDA_HOME", home or "not found (set CUDA_HOME)"),
        ("ninja", f"{_first_line(['ninja', '--version'])}" if ce.is_ninja_available()
         else "not found (pip install ninja)"),
        ("C++ compiler", f"{shutil.which(cxx)} ({_first_line([cxx, '--version'])})"
         if shutil.which(cxx) else f"not found ({cxx!r} is not on PATH)"),
        ("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR")
         or f"torch default ({ce.get_default_build_root()})"),
        ("extension sources", _build.csrc_dir() or "missing"),
        ("extension", st["reason"]),
        ("extension CUDA kernel", st["cuda_reason"]),
    ]


def print_report() -> None:
    for k, v in build_report():
        print(f"{k:>22}: {v}")


def smoke_test(mod, device: str) -> Optional[str]:
    """The extension's update_mems op (registered when ``mod`` was imported) against the
    pure-torch update_mems on a small random case."""
    g = torch.Generator().manual_seed(0)
    hids = [torch.randn(5, 3, 7, generator=g), torch.randn(2, 6, 9, generator=g).transpose(0, 1)]
    mems = [torch.randn(4, 3, 7, generator=g), torch.empty(0)]
    hids, mems = [h.to(device) for h in hids], [m.to(device) for m in mems]
    for layer, (a, b) in enumerate(zip(torch.ops.txl_kernels.update_mems(hids, mems, 6, 1),
                                       _update_mems_torch(hids, mems, 6, 1))):
        if not torch.equal(a, b):
            return f"layer {layer} on {device}: the extension differs from update_mems"
    return None


def check_cuda(arch: Optional[str] = None, verbose: bool = True) -> int:
    """Compile and link the extension with its CUDA sources; see the module docstring."""
    print_report()
    problems = _build.build_problems()
    if torch.version.cuda is None:
        problems.append("torch is not a CUDA build")
    elif _build.cuda_home() is None:
        problems.append("no CUDA toolkit (nvcc and its headers); set CUDA_HOME")
    if problems:
        print("check-cuda: FAILED: " + "; ".join(problems), file=sys.stderr)
        return 2
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    name = _build.EXT_NAME_CUDA
    folder = _build.build_directory(name)
    print(f"check-cuda: compiling {name} into {folder} for "
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST') or 'the visible GPUs / torch oldest arch'}",
          flush=True)
    t0 = time.perf_counter()
    try:
        mod = _build.compile_extension(name, with_cuda=True, verbose=verbose)
    except (ImportError, OSError) as exc:
        if re.search(r"libcuda\.so", str(exc)):
            print(f"check-cuda: OK: compiled and linked {name} in {time.perf_counter() - t0:.1f}"
                  f" s; it cannot be imported here only because the NVIDIA driver library is "
                  f"missing ({exc})")
            return 0
        print(f"check-cuda: FAILED: {name} was compiled but cannot be imported: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"check-cuda: FAILED: compiling/linking failed after "
              f"{time.perf_counter() - t0:.1f} s:\n{exc}", file=sys.stderr)
        return 1
    if not getattr(mod, "with_cuda", False):
        print("check-cuda: FAILED: the module was built without TXL_WITH_CUDA", file=sys.stderr)
        return 1
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        bad = smoke_test(mod, device)
        if bad:
            print(f"check-cuda: FAILED: {bad}", file=sys.stderr)
            return 1
    print(f"check-cuda: OK: {name} built (or found up to date) and imported in "
          f"{time.perf_counter() - t0:.1f} s; smoke test on {' and '.join(devices)} agrees")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.build_check",
                                description="Build report and JIT build of the txl_kernels "
                                            "C++/CUDA extension.")
    p.add_argument("--check-cuda", action="store_true",
                   help="compile and link the extension with its CUDA sources (no GPU needed)")
    p.add_argument("--arch", default=None,
                   help="TORCH_CUDA_ARCH_LIST for --check-cuda, e.g. '9.0' or '8.0;9.0+PTX'")
    p.add_argument("--quiet", action="store_true", help="do not echo the compiler commands")
    args = p.parse_args(argv)
    if args.check_cuda:
        return check_cuda(arch=args.arch, verbose=not args.quiet)
    print_report()
    mod = _build.load_extension(verbose=not args.quiet)
    st = _build.extension_status()
    if mod is None:
        print(f"extension: {st['reason']}", file=sys.stderr)
        return 1 if st["buildable"] else 2
    bad = smoke_test(mod, "cpu")
    print(f"extension: FAILED: {bad}" if bad else
          f"extension: {st['reason']}; CUDA kernel: {st['cuda_reason']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
