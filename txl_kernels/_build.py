"""JIT build of the C++/CUDA extension (``csrc/``): a thin layer over
``torch.utils.cpp_extension.load``, like DeepSpeed's ``jit_load``.

On first use :func:`load_extension` compiles every ``csrc/*.cpp`` (and, when torch is a CUDA
build, a toolkit is found and a GPU is visible, every ``*.cu`` with ``-DTXL_WITH_CUDA``) into
torch's extension cache (``$TORCH_EXTENSIONS_DIR`` or torch's default); torch and ninja decide
what is up to date. Each build has its own folder, ``<name>-<key>``: the key is a hash of the
sources' contents, the torch version, the Python ABI and torch's CUDA version
(:func:`build_key`), so two installs on one machine (an editable checkout and a wheel, two
virtual environments) each keep their own build instead of rebuilding each other's, and two
installs of the same sources share one. The sources are compiled from a copy inside that folder,
so the compile commands, and with them ninja's view of what is up to date, do not depend on
where the package is installed. The CPU-only and the CUDA build have different names, so they
never share a folder. When nothing can be built, :func:`load_extension` returns None and
:func:`extension_status` says why (``memory.update_mems`` then warns once and uses torch).
A cached library that cannot be loaded (e.g. a truncated .so: "invalid ELF header") is rebuilt
once into a fresh folder; if that fails too, the reason names the folders to delete.
The build report and the CI compile check live in ``tools/build_check.py`` (source tree only).
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import sys
import sysconfig
import threading
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch

EXT_NAME, EXT_NAME_CUDA = "txl_kernels_C", "txl_kernels_C_cuda"
_HERE = os.path.dirname(os.path.abspath(__file__))


def csrc_dir() -> Optional[str]:
    """``txl_kernels/csrc`` in a wheel, ``csrc/`` at the root of a source checkout."""
    for d in (os.path.join(_HERE, "csrc"), os.path.join(os.path.dirname(_HERE), "csrc")):
        if glob.glob(os.path.join(d, "*.cpp")):
            return d
    return None


def cpp_extension():
    """``torch.utils.cpp_extension``, imported without its 'No CUDA runtime is found' warning
    (expected without a GPU), with CUDA_HOME fixed by :func:`cuda_home`."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as ce
    finally:
        log.setLevel(level)
    cuda_home(ce)
    return ce


def cuda_home(ce=None) -> Optional[str]:
    """torch's CUDA_HOME, fixed where torch guessed it from an nvcc wrapper script (e.g.
    ``/usr/local/bin/nvcc`` running ``exec /usr/local/cuda-13.0/bin/nvcc "$@"`` gives
    ``/usr/local``, which has no CUDA headers): then the toolkit the script runs is used."""
    ce = ce or cpp_extension()
    ok = lambda h: bool(h) and os.path.isfile(os.path.join(h, "include", "cuda_runtime.h"))  # noqa: E731
    if ok(ce.CUDA_HOME) or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return ce.CUDA_HOME if ok(ce.CUDA_HOME) else None  # a toolkit the user chose is kept
    nvcc = shutil.which("nvcc")
    try:
        with open(os.path.realpath(nvcc or ""), "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    m = re.search(rb"(/\S+)/bin/nvcc\b", head) if head.startswith(b"#!") else None
    home = m and os.path.realpath(m.group(1).decode())
    if not ok(home):
        return None
    ce.CUDA_HOME = os.environ["CUDA_HOME"] = home
    return home


def build_problems() -> List[str]:
    """Why nothing can be built here (empty: the C++ part can be)."""
    ce, cxx = cpp_extension(), os.environ.get("CXX", "c++")
    return ([] if csrc_dir() else ["the C++ sources (csrc/*.cpp) are not installed"]) \
        + ([] if ce.is_ninja_available() else ["ninja was not found (pip install ninja)"]) \
        + ([] if shutil.which(cxx) else [f"no C++ compiler: {cxx!r} is not on PATH"])


def cuda_build_plan() -> Tuple[bool, str]:
    """(whether the CUDA sources are compiled in, why / why not)."""
    if torch.version.cuda is None:
        return False, "torch is not a CUDA build"
    home = cuda_home()
    if home is None:
        return False, "no CUDA toolkit (nvcc and its headers) was found; set CUDA_HOME"
    if not torch.cuda.is_available():
        return False, ("no CUDA device is visible, so the CUDA sources are not compiled "
                       "(tools/build_check.py --check-cuda compiles them without one)")
    return True, f"CUDA toolkit at {home}"


# compile flags: part of the build key, so a change of flags gets a fresh folder
CFLAGS, CUDA_FLAG = ["-O3"], "-DTXL_WITH_CUDA"
# at::parallel_for is a header template whose `#pragma omp parallel` is compiled into the
# extension: without -fopenmp it runs the whole range on the calling thread. GCC lowers the
# pragma to libgomp calls, which resolve to the libgomp that torch itself loads (one thread
# pool, torch.set_num_threads applies); other compilers would need their own runtime, so the
# flag is passed to GCC only, where torch's CPU parallel backend is OpenMP.
_OPENMP_CFLAGS = ["-fopenmp"]


def host_cflags() -> List[str]:
    """The C++ compile flags: :data:`CFLAGS`, plus ``-fopenmp`` where torch's parallel backend
    is OpenMP and the host compiler is GCC (cached after the first call)."""
    global _HOST_CFLAGS
    if _HOST_CFLAGS is None:
        flags = list(CFLAGS)
        try:
            ce = cpp_extension()
            if (torch.backends.openmp.is_available() and not sys.platform.startswith("win")
                    and ce.check_compiler_is_gcc(ce.get_cxx_compiler())):
                flags += _OPENMP_CFLAGS
        except Exception:  # no compiler found: the build reports that itself
            pass
        _HOST_CFLAGS = flags
    return _HOST_CFLAGS


_HOST_CFLAGS: Optional[List[str]] = None
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


def read_sources(src: Optional[str] = None) -> Dict[str, bytes]:
    """The extension's sources (every .cpp, .cu, .h, .cuh in ``src``, default
    :func:`csrc_dir`), by file name."""
    src = src or csrc_dir()
    if src is None:
        return {}
    return {os.path.basename(p): open(p, "rb").read()
            for p in sorted(glob.glob(os.path.join(src, "*")))
            if p.endswith(_SOURCE_SUFFIXES) and os.path.isfile(p)}


def build_key(sources: Optional[Dict[str, bytes]] = None) -> str:
    """16 hex digits identifying what a build depends on: the sources' names and contents
    (default :func:`read_sources`), the torch version (and commit), torch's CUDA version (or
    none), the Python ABI and the compile flags. Where the sources lie does not count."""
    sources = read_sources() if sources is None else sources
    h = hashlib.sha256()
    for part in (torch.__version__, getattr(torch.version, "git_version", ""),
                 f"cuda={torch.version.cuda}", f"hip={getattr(torch.version, 'hip', None)}",
                 sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX") or "",
                 sys.platform, repr((host_cflags(), CUDA_FLAG))):
        h.update(str(part).encode() + b"\0")
    for fname in sorted(sources):
        h.update(fname.encode() + b"\0" + hashlib.sha256(sources[fname]).digest())
    return h.hexdigest()[:16]


def build_directory(name: str, sources: Optional[Dict[str, bytes]] = None) -> str:
    """The build folder of the extension ``name`` for these sources (default
    :func:`read_sources`): ``<torch's extension root>/<name>-<build_key>``, created if
    missing."""
    return cpp_extension()._get_build_directory(f"{name}-{build_key(sources)}", verbose=False)


def _snapshot(sources: Dict[str, bytes], folder: str) -> str:
    """Copy ``sources`` into ``folder/src`` (files already there with the same contents are
    left alone, so ninja sees them unchanged); returns that folder."""
    dest = os.path.join(folder, "src")
    os.makedirs(dest, exist_ok=True)
    for fname, data in sources.items():
        path = os.path.join(dest, fname)
        try:
            with open(path, "rb") as f:
                if f.read() == data:
                    continue
        except OSError:
            pass
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return dest


@contextmanager
def _arch_list_without_device(with_cuda: bool):
    """torch picks the architectures of the visible GPUs; without one it needs
    TORCH_CUDA_ARCH_LIST, here the oldest architecture torch itself was built for."""
    if not with_cuda or torch.cuda.is_available() or os.environ.get("TORCH_CUDA_ARCH_LIST"):
        yield
        return
    sms = sorted(int(a[3:]) for a in torch.cuda.get_arch_list() if a[3:].isdigit())
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{sms[0] // 10}.{sms[0] % 10}" if sms else "8.0"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def compile_extension(name: str, with_cuda: bool, verbose: bool = False):
    """Build (ninja: only what changed) and import one extension; raises on failure."""
    from filelock import FileLock  # a torch dependency
    ce, files = cpp_extension(), read_sources()
    folder = build_directory(name, files)  # keyed by exactly the bytes compiled below
    if not glob.glob(os.path.join(folder, name + "*.so")) and not verbose:
        print(f"txl_kernels: compiling the extension {name} into {folder} (a minute or more)",
              file=sys.stderr, flush=True)
    # concurrent first builds: one process builds, the others wait, then load what it built
    # (torch's own lock covers only its build step, and older releases' FileBaton is a lock
    # file that a killed build leaves behind)
    with FileLock(folder + ".lock"), _arch_list_without_device(with_cuda):
        src = _snapshot(files, folder)
        # the .cu first: a broken CUDA source fails before the slow C++ compile (MAX_JOBS=1)
        sources = [os.path.join(src, f) for f in sorted(files)
                   if f.endswith(".cu") and with_cuda]
        sources += [os.path.join(src, f) for f in sorted(files) if f.endswith(".cpp")]
        return ce.load(name=name, sources=sources,
                       extra_cflags=host_cflags() + ([CUDA_FLAG] if with_cuda else []),
                       extra_cuda_cflags=CFLAGS if with_cuda else None,
                       extra_include_paths=[src], build_directory=folder, with_cuda=with_cuda,
                       verbose=verbose)


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


class CachedExtensionError(RuntimeError):
    """A cached extension cannot be loaded and rebuilding it failed."""


def load_or_rebuild(name: str, with_cuda: bool, verbose: bool = False):
    """:func:`compile_extension`, rebuilt once into the fresh folder ``<name>_rebuilt-<key>``
    when the cached library cannot be loaded (a failed import, not a failed compile)."""
    try:
        return compile_extension(name, with_cuda, verbose)
    except (ImportError, OSError) as exc:
        bad, fresh = build_directory(name), name + "_rebuilt"
        print(f"txl_kernels: the cached extension in {bad} cannot be loaded "
              f"({_first_line(exc)}); rebuilding it once in {build_directory(fresh)}",
              file=sys.stderr, flush=True)
        try:
            return compile_extension(fresh, with_cuda, verbose)
        except Exception as exc2:
            raise CachedExtensionError(
                f"the cached extension in {bad} cannot be loaded ({_first_line(exc)}) and "
                f"rebuilding it in {build_directory(fresh)} failed ({_first_line(exc2)}); "
                f"delete {bad} and {build_directory(fresh)}") from exc2


class _State:
    """What this process learnt about the extension (built or failed at most once)."""

    def __init__(self) -> None:
        self.lock, self.attempted, self.module, self.name = threading.Lock(), False, None, None
        self.reason, self.cuda_reason, self.log = "not built yet (compiled on first use)", "", ""


_STATE = _State()


def load_extension(verbose: bool = False):
    """The extension module (built on the first call), or None; see :func:`extension_status`."""
    st = _STATE
    with st.lock:
        if st.attempted:
            return st.module
        st.attempted = True
        problems = build_problems()
        if problems:
            st.reason = st.cuda_reason = "cannot build the C++ extension: " + "; ".join(problems)
            return None
        with_cuda, st.cuda_reason = cuda_build_plan()
        for name in ([EXT_NAME_CUDA] if with_cuda else []) + [EXT_NAME]:
            try:
                st.module, st.name = load_or_rebuild(name, name == EXT_NAME_CUDA, verbose), name
                st.reason = f"loaded {name} from {os.path.dirname(st.module.__file__)}"
                return st.module
            except Exception as exc:
                st.log += f"{exc}\n"
                st.reason = str(exc) if isinstance(exc, CachedExtensionError) else \
                    f"building {name} failed: {_first_line(exc)}"
                if name == EXT_NAME_CUDA:
                    st.cuda_reason = st.reason
        return None


def extension_status() -> Dict[str, object]:
    """loaded, attempted, buildable, reason, cuda_reason, with_cuda, name, log."""
    st, problems = _STATE, build_problems()
    return {"loaded": st.module is not None, "attempted": st.attempted,
            "buildable": not problems,
            "reason": st.reason if st.attempted or not problems
            else "cannot build the C++ extension: " + "; ".join(problems),
            "cuda_reason": st.cuda_reason or cuda_build_plan()[1],
            "with_cuda": bool(getattr(st.module, "with_cuda", False)),
            "name": st.name, "log": st.log}
