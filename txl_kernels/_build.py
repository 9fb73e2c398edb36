"""Just-in-time builder for the txl_kernels C++/CUDA extension (the segment-memory op).

In the style of DeepSpeed's op builders: nothing is compiled at install time. On first use,
:func:`load_extension` compiles ``csrc/`` with ``torch.utils.cpp_extension.load`` and ninja into
the torch extensions cache (``$TORCH_EXTENSIONS_DIR``, else torch's default
``~/.cache/torch_extensions/<py>_<cu>``), once per process; later processes find the cached
library and ninja has nothing to do. When the extension cannot be built, :func:`load_extension`
returns None and :func:`extension_status` says why; ``txl_kernels.memory.update_mems`` then
falls back to pure torch and warns once.

What is compiled:

* ``segment_memory.cpp`` (CPU implementation + pybind11 binding): always.
* ``segment_memory_cuda.cu`` (the single-launch CUDA kernel), with ``-DTXL_WITH_CUDA``: only
  when torch is a CUDA build, a CUDA toolkit (nvcc + headers) is found, and a CUDA device is
  visible. Without a device no CUDA tensor can exist in the process, so the (slow) nvcc compile
  would be wasted; the CPU-only build ``txl_kernels_C`` is used instead. The CUDA build is
  named ``txl_kernels_C_cuda`` so the two never overwrite each other in the cache. If the CUDA
  build fails, a CPU-only build is tried so CPU tensors still get the C++ path.

CUDA_HOME: torch guesses it from ``which nvcc`` (``/usr/local/bin/nvcc`` -> ``/usr/local``),
which is wrong when nvcc is a wrapper script. :func:`configure_cuda_home` checks candidates
($CUDA_HOME / $CUDA_PATH, the real nvcc on PATH and the target a wrapper script execs,
/usr/local/cuda, /usr/local/cuda-*, /opt/cuda) for ``include/cuda_runtime.h`` and ``bin/nvcc``,
preferring the toolkit whose major version matches ``torch.version.cuda``, and sets both
``os.environ["CUDA_HOME"]`` and ``torch.utils.cpp_extension.CUDA_HOME``.

Command line::

    python -m txl_kernels._build               # report, then build/load for this machine
    python -m txl_kernels._build --check-cuda  # CI: compile + link the CUDA sources (no GPU needed)

``--check-cuda`` compiles both sources with nvcc/c++ (for ``--arch``, default
``$TORCH_CUDA_ARCH_LIST``, else the visible GPUs, else the oldest architecture torch was built
for), links the library, then tries to import it. Exit status: 0 when compiling and linking
succeeded and the import succeeded (plus a CPU smoke test, and a CUDA one when a GPU is
visible) or failed *only* because the NVIDIA driver library (libcuda.so) is missing; 1 when a
compile or link step failed (the compiler output is printed), the import failed for any other
reason (e.g. an undefined symbol: the link step of a shared library does not catch those), or
a smoke test disagreed with the formula; 2 when the environment cannot compile CUDA at all
(no nvcc/CUDA_HOME, CPU-only torch, no ninja, no C++ compiler).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["load_extension", "extension_status", "build_report", "configure_cuda_home",
           "find_cuda_home", "find_ninja", "find_cxx", "build_problems", "cuda_build_plan",
           "extensions_root", "build_directory", "csrc_dir", "check_cuda", "EXT_NAME",
           "EXT_NAME_CUDA"]

EXT_NAME = "txl_kernels_C"            # CPU-only build
EXT_NAME_CUDA = "txl_kernels_C_cuda"  # CPU + CUDA build
CPP_SOURCES = ("segment_memory.cpp",)
CUDA_SOURCES = ("segment_memory_cuda.cu",)
HEADERS = ("segment_memory.h",)
CXX_FLAGS = ["-O3"]
CUDA_FLAGS = ["-O3"]
_PREFIX = "txl_kernels"


def _say(msg: str) -> None:
    print(f"{_PREFIX}: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tool discovery

def csrc_dir() -> Optional[Path]:
    """Folder holding the C++/CUDA sources: ``txl_kernels/csrc`` in a wheel, the top-level
    ``csrc/`` of the source tree (plain checkout or editable install)."""
    here = Path(__file__).resolve().parent
    candidates = [here / "csrc"]
    try:
        spec = importlib.util.find_spec(f"{__package__ or 'txl_kernels'}.csrc")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) for p in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    candidates.append(here.parent / "csrc")
    for c in candidates:
        if all((c / f).is_file() for f in CPP_SOURCES + CUDA_SOURCES + HEADERS):
            return c
    return None


def _cuda_version_of(home: str) -> Optional[str]:
    """'13.0' from include/cuda_runtime_api.h (CUDART_VERSION 13000), without running nvcc."""
    try:
        text = Path(home, "include", "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if not m:
        return None
    v = int(m.group(1))
    return f"{v // 1000}.{(v % 1000) // 10}"


def _valid_cuda_home(home: Optional[str]) -> bool:
    return bool(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")) \
        and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK)


def _nvcc_wrapper_target(path: str) -> Optional[str]:
    """If ``path`` is a small shell script that execs a real nvcc, return that nvcc."""
    try:
        if os.path.getsize(path) > 65536:
            return None
        with open(path, "rb") as f:
            head = f.read()
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    for m in re.finditer(rb"(/[^\s\"'`;|&()]+/bin/nvcc)(?![\w.-])", head):
        target = m.group(1).decode(errors="replace")
        if os.path.realpath(target) != os.path.realpath(path) and os.access(target, os.X_OK):
            return target
    return None


def _version_key(path: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(path))) or (0,)


def find_cuda_home() -> Tuple[Optional[str], str]:
    """(CUDA toolkit root or None, how it was found / why none was)."""
    env_name = "CUDA_HOME" if os.environ.get("CUDA_HOME") else "CUDA_PATH"
    env = os.environ.get(env_name)
    notes = []
    if env:
        if _valid_cuda_home(env):
            return env, f"${env_name}"
        notes.append(f"${env_name}={env} has no include/cuda_runtime.h and bin/nvcc")
    cands: List[Tuple[str, str]] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        cands.append((os.path.dirname(os.path.dirname(real)), f"nvcc on PATH ({nvcc})"))
        target = _nvcc_wrapper_target(real)
        if target:
            cands.append((os.path.dirname(os.path.dirname(os.path.realpath(target))),
                          f"the nvcc that the wrapper {nvcc} runs ({target})"))
    cands.append(("/usr/local/cuda", "default location"))
    for p in sorted(glob.glob("/usr/local/cuda-*"), key=_version_key, reverse=True):
        cands.append((p, "installed toolkit"))
    cands.append(("/opt/cuda", "default location"))
    valid = []
    seen = set()
    for home, how in cands:
        key = os.path.realpath(home)
        if key in seen:
            continue
        seen.add(key)
        if _valid_cuda_home(home):
            valid.append((home, how))
    if not valid:
        searched = ", ".join(dict.fromkeys(h for h, _ in cands))
        notes.append(f"no CUDA toolkit (include/cuda_runtime.h + bin/nvcc) in: {searched}")
        return None, "; ".join(notes)
    want = (torch.version.cuda or "").split(".")[0]
    if want:
        for home, how in valid:
            if (_cuda_version_of(home) or "").split(".")[0] == want:
                return home, "; ".join(notes + [how])
    home, how = valid[0]
    return home, "; ".join(notes + [how])


_CONFIGURED: Optional[Tuple[str, str]] = None  # (CUDA_HOME we set, how it was found)


def cuda_home_info() -> Tuple[Optional[str], str]:
    """Like :func:`find_cuda_home`, but reports how a CUDA_HOME that
    :func:`configure_cuda_home` set was originally found."""
    if _CONFIGURED is not None and os.environ.get("CUDA_HOME") == _CONFIGURED[0]:
        return _CONFIGURED
    return find_cuda_home()


def configure_cuda_home() -> Optional[str]:
    """Find the CUDA toolkit and make torch's builder use it: sets ``os.environ['CUDA_HOME']``
    and the module global ``torch.utils.cpp_extension.CUDA_HOME`` (read at build time).
    Returns the toolkit root, or None (nothing is changed then)."""
    global _CONFIGURED
    if _CONFIGURED is not None and os.environ.get("CUDA_HOME") == _CONFIGURED[0]:
        home = _CONFIGURED[0]
    else:
        home, how = find_cuda_home()
        if home is None:
            return None
        _CONFIGURED = (home, how)
    os.environ["CUDA_HOME"] = home
    mod = sys.modules.get("torch.utils.cpp_extension")
    if mod is not None:
        mod.CUDA_HOME = home
    return home


def _cpp_extension():
    """Import torch.utils.cpp_extension after fixing CUDA_HOME, without its import-time
    'No CUDA runtime is found' warning (expected on a machine without a GPU)."""
    if "torch.utils.cpp_extension" not in sys.modules:
        configure_cuda_home()
        log = logging.getLogger("torch.utils.cpp_extension")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            mod = importlib.import_module("torch.utils.cpp_extension")
        finally:
            log.setLevel(level)
    else:
        mod = sys.modules["torch.utils.cpp_extension"]
    home = configure_cuda_home()
    if home is not None:
        mod.CUDA_HOME = home
    return mod


def _extra_ninja_dirs() -> List[str]:
    """Where a pip-installed ninja lives when the virtual environment is not activated."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore
        dirs.append(str(getattr(ninja, "BIN_DIR", "")))
    except Exception:
        pass
    return [d for d in dirs if d]


def find_ninja() -> Optional[str]:
    """Path of a working ninja, or None. torch runs plain ``ninja``, so a ninja found outside
    PATH (a venv that is not activated) has its folder prepended to PATH."""
    exe = shutil.which("ninja")
    if exe:
        return exe
    for d in _extra_ninja_dirs():
        cand = os.path.join(d, "ninja")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return cand
    return None


def find_cxx() -> Tuple[Optional[str], str]:
    """(path of the C++ compiler torch will use, its name: $CXX or c++)."""
    name = os.environ.get("CXX", "c++")
    return shutil.which(name), name


def _first_line(cmd: List[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(cannot run: {exc})"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else ""


def _nvcc_version(home: str) -> str:
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(cannot run: {exc})"
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    if m:
        return f"{m.group(1)} ({m.group(2)})"
    lines = out.strip().splitlines()
    return lines[-1] if lines else "(no version output)"


def extensions_root() -> str:
    """Root of the torch extensions cache: $TORCH_EXTENSIONS_DIR as is, else torch's default
    root plus its <python>_<accelerator> folder (what torch.utils.cpp_extension.load uses)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return env
    ce = _cpp_extension()
    if torch.version.hip is not None:
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(ce.get_default_build_root(), f"{py}_{acc}")


def build_directory(name: str = EXT_NAME) -> str:
    """Folder the named extension is built and cached in (not created here)."""
    return os.path.join(extensions_root(), name)


def build_problems() -> List[str]:
    """Reasons the extension cannot be built at all here (empty list: it can be built)."""
    problems = []
    if csrc_dir() is None:
        problems.append("the C++ sources (csrc/segment_memory.cpp, ...) are not installed "
                        "with the package")
    if find_ninja() is None:
        problems.append("ninja was not found (pip install ninja, or put it on PATH)")
    cxx, name = find_cxx()
    if cxx is None:
        problems.append(f"no C++ compiler: {name!r} is not on PATH (install g++, or set CXX)")
    return problems


def cuda_build_plan(require_device: bool = True) -> Tuple[bool, str]:
    """(whether the CUDA sources are compiled in, why / why not)."""
    if torch.version.cuda is None:
        return False, ("torch is not a CUDA build" if torch.version.hip is None
                       else "torch is a ROCm build; the CUDA kernel is not hipified")
    home, how = find_cuda_home()
    if home is None:
        return False, f"no CUDA toolkit (nvcc) found: {how}; set CUDA_HOME"
    if require_device and not torch.cuda.is_available():
        return False, ("no CUDA device is visible, so the CUDA sources are not compiled "
                       "(run `python -m txl_kernels._build --check-cuda` to compile them anyway)")
    return True, f"CUDA toolkit {_cuda_version_of(home) or '?'} at {home} ({how})"


# --------------------------------------------------------------------------- building

class _State:
    """What this process learnt about the extension. Built (or failed) at most once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempted = False
        self.module = None
        self.name: Optional[str] = None
        self.reason = "not built yet (compiled on first use)"
        self.with_cuda = False
        self.cuda_reason = "not built yet"
        self.log = ""
        self.build_seconds: Optional[float] = None


_STATE = _State()


def _sources(with_cuda: bool) -> List[str]:
    d = csrc_dir()
    assert d is not None
    names = CPP_SOURCES + (CUDA_SOURCES if with_cuda else ())
    return [str(d / n) for n in names]


def _library_up_to_date(name: str, sources: List[str]) -> bool:
    lib = Path(build_directory(name), f"{name}.so")
    if not lib.is_file() or not Path(build_directory(name), "build.ninja").is_file():
        return False
    d = Path(sources[0]).parent
    newest = max(os.path.getmtime(p) for p in sources + [str(d / h) for h in HEADERS])
    return lib.stat().st_mtime >= newest


def _arch_flags_without_device(arch: Optional[str]) -> List[str]:
    """nvcc -gencode flags when no GPU is visible (torch's own choice needs a device)."""
    spec = arch or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not spec:
        sms = sorted(int(a[3:]) for a in torch.cuda.get_arch_list()
                     if a.startswith("sm_") and a[3:].isdigit())
        spec = f"{sms[0] // 10}.{sms[0] % 10}" if sms else "8.0"
    flags = []
    for item in re.split(r"[;\s,]+", spec.strip()):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        num = item.replace("+PTX", "").replace(".", "")
        if not re.fullmatch(r"\d+a?", num):
            raise ValueError(f"--arch / TORCH_CUDA_ARCH_LIST: cannot parse {item!r}")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _compile(name: str, with_cuda: bool, verbose: bool, arch: Optional[str] = None):
    """Build (or load the cached) extension; raises on failure."""
    ce = _cpp_extension()
    sources = _sources(with_cuda)
    cflags = CXX_FLAGS + (["-DTXL_WITH_CUDA"] if with_cuda else [])
    cuda_flags = list(CUDA_FLAGS)
    if with_cuda and (arch or not torch.cuda.is_available()):
        cuda_flags += _arch_flags_without_device(arch)
    os.makedirs(build_directory(name), exist_ok=True)
    fresh = _library_up_to_date(name, sources)
    t0 = time.perf_counter()
    if not fresh:
        what = "C++ and CUDA sources" if with_cuda else "C++ sources (CPU only)"
        _say(f"compiling the extension {name} from its {what} into {build_directory(name)}; "
             f"the first build takes a minute or more")
    mod = ce.load(name=name, sources=sources, extra_cflags=cflags,
                  extra_cuda_cflags=cuda_flags if with_cuda else None,
                  extra_include_paths=[str(Path(sources[0]).parent)],
                  build_directory=build_directory(name), with_cuda=with_cuda, verbose=verbose)
    dt = time.perf_counter() - t0
    if not fresh:
        _say(f"built {name} in {dt:.1f} s")
    return mod, dt


def load_extension(verbose: bool = False):
    """The compiled extension module (built on first call, then cached), or None when it
    cannot be built here; :func:`extension_status` then says why."""
    st = _STATE
    if st.attempted:
        return st.module
    with st.lock:
        if st.attempted:
            return st.module
        try:
            problems = build_problems()
            if problems:
                st.reason = "cannot build the C++ extension: " + "; ".join(problems)
                st.cuda_reason = st.reason
                return None
            want_cuda, why = cuda_build_plan(require_device=True)
            if want_cuda:
                try:
                    st.module, st.build_seconds = _compile(EXT_NAME_CUDA, True, verbose)
                    st.name, st.with_cuda, st.cuda_reason = EXT_NAME_CUDA, True, why
                    st.reason = f"loaded {EXT_NAME_CUDA} (CPU and CUDA kernels)"
                    return st.module
                except Exception as exc:  # fall back to a CPU-only build
                    st.log = str(exc)
                    why = "building the CUDA sources failed: " + _short(exc)
                    _say(f"{why}; trying a CPU-only build")
            st.cuda_reason = why
            try:
                st.module, st.build_seconds = _compile(EXT_NAME, False, verbose)
                st.name = EXT_NAME
                st.reason = f"loaded {EXT_NAME} (CPU kernel only)"
            except Exception as exc:
                st.log = (st.log + "\n" + str(exc)).strip()
                st.reason = "building the C++ extension failed: " + _short(exc)
                st.module = None
            return st.module
        finally:
            st.attempted = True


def _short(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    pick = " | ".join((lines[:1] + errs[:3]) if errs else lines[:4])
    return pick if len(pick) <= limit else pick[:limit] + " ..."


def extension_status() -> Dict[str, object]:
    """What is known about the extension without building it: loaded, attempted, buildable,
    reason, with_cuda, cuda_reason, name, build_dir, build_seconds, log (compiler output of a
    failed build)."""
    st = _STATE
    problems = build_problems()
    if st.attempted:
        reason, cuda_reason = st.reason, st.cuda_reason
    else:
        reason = ("cannot build the C++ extension: " + "; ".join(problems) if problems
                  else "not built yet (compiled on first use)")
        cuda_reason = cuda_build_plan(require_device=True)[1]
    name = st.name or (EXT_NAME_CUDA if cuda_build_plan(True)[0] else EXT_NAME)
    return {
        "loaded": st.module is not None,
        "attempted": st.attempted,
        "buildable": not problems,
        "reason": reason,
        "with_cuda": bool(st.module is not None and getattr(st.module, "with_cuda", False)),
        "cuda_reason": cuda_reason,
        "name": name,
        "build_dir": build_directory(name),
        "build_seconds": st.build_seconds,
        "log": st.log,
    }


def build_report() -> List[Tuple[str, str]]:
    """Environment and build report, one (key, value) per line, like DeepSpeed's ds_report.
    Never compiles anything."""
    rows: List[Tuple[str, str]] = []
    rows.append(("torch", f"{torch.__version__} ({'CUDA' if torch.version.cuda else 'CPU'} "
                          f"build) at {os.path.dirname(torch.__file__)}"))
    rows.append(("torch CUDA runtime", torch.version.cuda or "none (not a CUDA build)"))
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        cap = torch.cuda.get_device_capability(0)
        dev = f"{n} x {torch.cuda.get_device_name(0)} (sm_{cap[0]}{cap[1]})"
    else:
        dev = "none visible"
    rows.append(("CUDA device", dev))
    try:
        import triton
        rows.append(("triton", f"{triton.__version__}"))
    except Exception as exc:
        rows.append(("triton", f"not importable ({type(exc).__name__}: {exc})"))
    _cpp_extension()  # fixes CUDA_HOME first
    home, how = cuda_home_info()
    nvcc_on_path = shutil.which("nvcc")
    if home:
        rows.append(("nvcc", f"{os.path.join(home, 'bin', 'nvcc')}, release "
                             f"{_nvcc_version(home)}"
                     + (f" (on PATH as {nvcc_on_path})" if nvcc_on_path else "")))
        rows.append(("CUDA_HOME", f"{home} (found via {how})"))
    else:
        rows.append(("nvcc", f"not found{' (PATH has ' + nvcc_on_path + ')' if nvcc_on_path else ''}"))
        rows.append(("CUDA_HOME", f"not found: {how}"))
    ninja = find_ninja()
    rows.append(("ninja", f"{ninja} ({_first_line([ninja, '--version'])})" if ninja
                 else "not found (pip install ninja)"))
    cxx, cxx_name = find_cxx()
    rows.append(("C++ compiler", f"{cxx} ({_first_line([cxx, '--version'])})" if cxx
                 else f"not found ({cxx_name!r} not on PATH)"))
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    rows.append(("TORCH_EXTENSIONS_DIR", f"{extensions_root()}"
                 + (" (from $TORCH_EXTENSIONS_DIR)" if env else " (torch default)")))
    src = csrc_dir()
    rows.append(("extension sources", str(src) if src else "missing"))
    status = extension_status()
    if status["loaded"]:
        ext = status["reason"]
    elif status["attempted"] or not status["buildable"]:
        ext = f"not available: {status['reason']}"
    else:
        lib = Path(status["build_dir"], f"{status['name']}.so")
        cached = " (a cached build exists)" if lib.is_file() else ""
        ext = f"buildable, not built in this process yet{cached}: {status['name']} in " \
              f"{status['build_dir']}"
    rows.append(("extension", ext))
    if status["loaded"]:
        cuda_line = ("yes" if status["with_cuda"] else "no") + f": {status['cuda_reason']}"
    else:
        ok, why = cuda_build_plan(require_device=True)
        cuda_line = ("will be compiled: " if ok else "not compiled: ") + why
    rows.append(("extension CUDA kernel", cuda_line))
    return rows


# --------------------------------------------------------------------------- CLI

def _smoke_test(mod, device: str) -> Optional[str]:
    """Compare the extension with the formula on a small random case; None when equal."""
    g = torch.Generator().manual_seed(0)
    hids = [torch.randn(5, 3, 7, generator=g), torch.randn(2, 6, 9, generator=g).transpose(0, 1)]
    mems = [torch.randn(4, 3, 7, generator=g), torch.empty(0)]
    hids = [h.to(device) for h in hids]
    mems = [m.to(device) for m in mems]
    outs = mod.update_mems(hids, mems, 6, 1)
    for l, (h, m, o) in enumerate(zip(hids, mems, outs)):
        mlen = m.size(0) if m.dim() == 3 else 0
        end = mlen + max(0, h.size(0) - 1)
        beg = max(0, end - 6)
        want = torch.cat([m, h], 0)[beg:end] if mlen else h[beg:end]
        if not torch.equal(o, want):
            return f"layer {l} on {device}: extension result differs from the formula"
    return None


def check_cuda(arch: Optional[str] = None, verbose: bool = True) -> int:
    """Compile and link the extension including its CUDA sources; see the module docstring
    for the exit statuses."""
    for k, v in build_report():
        print(f"{k:>22}: {v}")
    if torch.version.cuda is None:
        print("check-cuda: FAILED: torch is not a CUDA build", file=sys.stderr)
        return 2
    home, how = find_cuda_home()
    if home is None:
        print(f"check-cuda: FAILED: no CUDA toolkit: {how}", file=sys.stderr)
        return 2
    problems = build_problems()
    if problems:
        print("check-cuda: FAILED: " + "; ".join(problems), file=sys.stderr)
        return 2
    configure_cuda_home()
    name = EXT_NAME_CUDA
    arch_note = (arch or os.environ.get("TORCH_CUDA_ARCH_LIST")
                 or ("visible GPUs" if torch.cuda.is_available() else None))
    if arch_note is None:
        arch_note = " ".join(f.split("code=")[-1] for f in _arch_flags_without_device(None))
    print(f"check-cuda: compiling {name} with nvcc {_nvcc_version(home)} from {home} "
          f"for {arch_note}", flush=True)
    cached = _library_up_to_date(name, _sources(True))
    t0 = time.perf_counter()
    try:
        mod, _ = _compile(name, True, verbose, arch=arch)
    except RuntimeError as exc:
        if "Error building extension" in str(exc) or not _built(name):
            print(f"check-cuda: FAILED: compiling/linking failed after "
                  f"{time.perf_counter() - t0:.1f} s:\n{exc}", file=sys.stderr)
            return 1
        return _import_failure(name, exc, t0)
    except (ImportError, OSError) as exc:
        return _import_failure(name, exc, t0)
    dt = time.perf_counter() - t0
    if not getattr(mod, "with_cuda", False):
        print("check-cuda: FAILED: the module was built without TXL_WITH_CUDA", file=sys.stderr)
        return 1
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        bad = _smoke_test(mod, device)
        if bad:
            print(f"check-cuda: FAILED: {bad}", file=sys.stderr)
            return 1
    ran = "CPU and CUDA" if torch.cuda.is_available() else "CPU (no GPU visible)"
    how = ("cached build is up to date (ninja checked it)" if cached and dt < 5
           else f"compiled, linked and imported {name} in {dt:.1f} s")
    print(f"check-cuda: OK: {how}; smoke test on {ran} matches the formula")
    return 0


def _built(name: str) -> bool:
    return Path(build_directory(name), f"{name}.so").is_file()


def _import_failure(name: str, exc: BaseException, t0: float) -> int:
    dt = time.perf_counter() - t0
    msg = str(exc)
    if _built(name) and re.search(r"libcuda\.so", msg):
        print(f"check-cuda: OK: compiled and linked {name} in {dt:.1f} s; it cannot be "
              f"imported here only because the NVIDIA driver library is missing ({msg})")
        return 0
    print(f"check-cuda: FAILED: {name} was compiled but cannot be imported: "
          f"{type(exc).__name__}: {msg}", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m txl_kernels._build",
                                description="Build report and JIT build of the txl_kernels "
                                            "C++/CUDA extension.")
    p.add_argument("--check-cuda", action="store_true",
                   help="compile and link the extension including its CUDA sources (works "
                        "without a GPU; for CI)")
    p.add_argument("--arch", default=None,
                   help="CUDA architectures for --check-cuda, e.g. '9.0' or '8.0;9.0+PTX' "
                        "(default: $TORCH_CUDA_ARCH_LIST, the visible GPUs, else the oldest "
                        "architecture torch supports)")
    p.add_argument("--quiet", action="store_true", help="do not echo the ninja/compiler commands")
    args = p.parse_args(argv)
    if args.check_cuda:
        return check_cuda(arch=args.arch, verbose=not args.quiet)
    for k, v in build_report():
        print(f"{k:>22}: {v}")
    mod = load_extension(verbose=not args.quiet)
    st = extension_status()
    if mod is None:
        print(f"extension: {st['reason']}", file=sys.stderr)
        return 1 if st["buildable"] else 2
    bad = _smoke_test(mod, "cpu")
    if bad:
        print(f"extension: FAILED: {bad}", file=sys.stderr)
        return 1
    print(f"extension: {st['reason']}; CUDA kernel: "
          f"{'yes' if st['with_cuda'] else 'no'} ({st['cuda_reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
