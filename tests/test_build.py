"""txl_kernels._build (the thin JIT layer over torch.utils.cpp_extension.load) and
tools/build_check.py (the build report and CI's ``--check-cuda``).

Clear reasons when the extension cannot be built (no ninja, no compiler), CUDA_HOME through an
nvcc wrapper script, build folders keyed by the sources' contents and the torch / Python / CUDA
versions (two installs keep their own builds), a corrupted cached library rebuilt once, and
``python -m tools.build_check --check-cuda``: compiles and links the CUDA sources without a GPU,
and fails, showing the compiler output, when a source is broken.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from tools import build_check
from txl_kernels import _build, _cpp_ops, memory

ROOT = Path(__file__).resolve().parents[1]
REPORT_KEYS = ["torch", "torch CUDA runtime", "CUDA device", "triton", "nvcc", "CUDA_HOME",
               "ninja", "C++ compiler", "TORCH_EXTENSIONS_DIR", "extension sources", "extension",
               "extension CUDA kernel"]

HAVE_TOOLKIT = torch.version.cuda is not None and _build.cuda_home() is not None
requires_toolkit = pytest.mark.skipif(
    not HAVE_TOOLKIT or bool(_build.build_problems()),
    reason="needs a CUDA build of torch, a CUDA toolkit (nvcc), ninja and a C++ compiler")


@pytest.fixture
def fresh_state(monkeypatch):
    """A build state as in a new process (restored afterwards)."""
    st = _build._State()
    monkeypatch.setattr(_build, "_STATE", st)
    monkeypatch.setattr(_cpp_ops, "_WARNED", set())
    return st


def test_report_has_the_expected_keys_and_builds_nothing(fresh_state):
    rows = build_check.build_report()
    assert [k for k, _ in rows] == REPORT_KEYS
    assert all(isinstance(v, str) and v for _, v in rows)
    report = dict(rows)
    assert torch.__version__ in report["torch"]
    assert report["torch CUDA runtime"] == (torch.version.cuda or "none (not a CUDA build)")
    assert report["CUDA device"] == "none visible" or torch.cuda.is_available()
    if HAVE_TOOLKIT:
        assert report["CUDA_HOME"] == _build.cuda_home()
        assert "release" in report["nvcc"]
    assert not fresh_state.attempted, "build_report must not build the extension"


def test_loaded_extension_lives_in_torchs_build_folder(extension):
    st = _build.extension_status()
    assert Path(extension.__file__).parent == Path(_build.build_directory(st["name"]))
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        assert Path(extension.__file__).is_relative_to(os.environ["TORCH_EXTENSIONS_DIR"])
    assert st["loaded"] and st["reason"].startswith("loaded")
    assert _build.load_extension() is extension, "built (and loaded) once per process"
    assert build_check.smoke_test(extension, "cpu") is None


def test_missing_ninja_gives_a_clear_reason(monkeypatch, tmp_path, fresh_state):
    monkeypatch.setenv("PATH", str(tmp_path))          # no ninja (nor anything else) on PATH
    assert not cpp_extension.is_ninja_available()
    assert any("ninja was not found" in p for p in _build.build_problems())
    assert _build.load_extension() is None
    st = _build.extension_status()
    assert st["attempted"] and not st["loaded"] and not st["buildable"]
    assert "cannot build the C++ extension" in st["reason"] and "ninja" in st["reason"]
    assert dict(build_check.build_report())["ninja"].startswith("not found")


def test_missing_compiler_gives_a_clear_reason(monkeypatch, fresh_state):
    monkeypatch.setenv("CXX", "/nonexistent/g++-42")
    assert any("no C++ compiler" in p and "g++-42" in p for p in _build.build_problems())
    assert _build.load_extension() is None
    assert "no C++ compiler" in _build.extension_status()["reason"]


def _fake_toolkit(root: Path) -> Path:
    home = root / "cuda-fake"
    (home / "include").mkdir(parents=True)
    (home / "bin").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("// fake\n")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.9, V99.9.1'\n")
    nvcc.chmod(0o755)
    return home


def test_cuda_home_found_through_an_nvcc_wrapper(monkeypatch, tmp_path):
    """torch guesses CUDA_HOME = dirname(dirname(which nvcc)); a wrapper script in
    <prefix>/bin makes that <prefix>, which has no CUDA headers. The builder follows the
    wrapper to the real toolkit and tells torch; a CUDA_HOME the user set is left alone."""
    home = _fake_toolkit(tmp_path)
    wrapper_dir = tmp_path / "local" / "bin"
    wrapper_dir.mkdir(parents=True)
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "local"))  # torch's guess
    assert _build.cuda_home() == str(home)
    assert cpp_extension.CUDA_HOME == str(home) and os.environ["CUDA_HOME"] == str(home)
    # an explicit CUDA_HOME without headers is not replaced: no toolkit then
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "local"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "local"))
    assert _build.cuda_home() is None
    if torch.version.cuda is not None:
        ok, why = _build.cuda_build_plan()
        assert not ok and "no CUDA toolkit" in why


# ---------------------------------------------------------------- tiny extension, cache

_TINY = textwrap.dedent("""
    // A module with the extension's name and no torch headers: builds in about a second.
    #include <Python.h>
    #define TXL_CAT2(a, b) a##b
    #define TXL_CAT(a, b) TXL_CAT2(a, b)
    #define TXL_STR2(a) #a
    #define TXL_STR(a) TXL_STR2(a)
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, TXL_STR(TORCH_EXTENSION_NAME),
                                     nullptr, -1, nullptr};
    PyMODINIT_FUNC TXL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
      PyObject* m = PyModule_Create(&def);
      if (m) PyModule_AddIntConstant(m, "with_cuda", 0);
      return m;
    }
""")


@pytest.fixture
def tiny_cache(monkeypatch, tmp_path, fresh_state):
    """A fresh TORCH_EXTENSIONS_DIR holding a built (tiny) extension under a unique name; the
    first build runs in a subprocess, so this process has never loaded the library."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "tiny.cpp").write_text(_TINY)
    name = f"txl_tiny_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_build, "csrc_dir", lambda: str(src))
    monkeypatch.setattr(_build, "EXT_NAME", name)
    code = (f"from txl_kernels import _build; _build.csrc_dir = lambda: {str(src)!r}; "
            f"print(_build.compile_extension({name!r}, False).__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return name, Path(r.stdout.strip().splitlines()[-1])


def _corrupt(lib: Path) -> None:
    lib.unlink()                       # a new file: never the one the loader may have mapped
    lib.write_bytes(b"not a shared library, e.g. an interrupted copy\n" * 64)


def test_corrupted_cache_is_rebuilt_once_into_a_fresh_folder(tiny_cache, capfd):
    name, lib = tiny_cache
    _corrupt(lib)
    mod = _build.load_extension()
    err = capfd.readouterr().err
    assert mod is not None, _build.extension_status()
    fresh = Path(_build.build_directory(name + "_rebuilt"))
    assert Path(mod.__file__).parent == fresh
    assert "cannot be loaded" in err and "invalid ELF header" in err and str(fresh) in err, err
    assert _build.extension_status()["loaded"]


def test_corrupted_cache_and_failed_rebuild_name_the_folders(tiny_cache, monkeypatch):
    name, lib = tiny_cache
    _corrupt(lib)
    real = _build.compile_extension

    def compile_extension(n, with_cuda, verbose=False):
        if n.endswith("_rebuilt"):  # the fresh build fails too (the source broke meanwhile)
            (Path(_build.csrc_dir()) / "tiny.cpp").write_text("#error the rebuild fails\n")
        return real(n, with_cuda, verbose)

    monkeypatch.setattr(_build, "compile_extension", compile_extension)
    assert _build.load_extension() is None
    folder, fresh = lib.parent, Path(_build.build_directory(name + "_rebuilt"))
    reason = _build.extension_status()["reason"]
    assert f"delete {folder} and {fresh}" in reason, reason
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        memory.update_mems([torch.randn(3, 2, 4)], None, 2)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and f"delete {folder} and {fresh}" in msgs[0], msgs
    assert "invalid ELF header" in msgs[0] and msgs[0].count("failed") == 1, msgs[0]


# ---------------------------------------------------------------- tools/build_check --check-cuda

def _run_check_cuda(env_extra, root=ROOT, timeout=900):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, "-m", "tools.build_check", "--check-cuda", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=root)


@pytest.mark.slow  # compiles the CUDA sources with nvcc
@requires_toolkit
def test_check_cuda_compiles_the_cuda_sources():
    """What CI runs: compile + link (and import, where possible) the CUDA build. Uses the
    normal extension cache, so after CI's own --check-cuda run this is a no-op build."""
    r = _run_check_cuda({})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "check-cuda: OK" in out


@pytest.mark.slow  # compiles the CUDA sources with nvcc
@requires_toolkit
def test_check_cuda_fails_on_a_broken_cuda_source(tmp_path):
    """A broken .cu makes --check-cuda exit 1 and show the compiler's error."""
    for folder in ("txl_kernels", "tools", "csrc"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    cu = tmp_path / "csrc" / "segment_memory_cuda.cu"
    text = cu.read_text()
    assert "const int64_t rows = L.n * L.bsz;" in text
    cu.write_text(text.replace("const int64_t rows = L.n * L.bsz;",
                               "const int64_t rows = L.n * L.bsz + txl_broken_symbol;"))
    # MAX_JOBS=1: ninja compiles the .cu first and stops at its error (no parallel .cpp build)
    r = _run_check_cuda({"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MAX_JOBS": "1"},
                        root=tmp_path)
    out = r.stdout + r.stderr
    assert f"extension sources: {tmp_path / 'csrc'}" in out, out  # compiled the broken copy
    assert r.returncode == 1, out
    assert "check-cuda: FAILED" in out and "txl_broken_symbol" in out, out


# ---------------------------------------------------------------- build folder per sources


def _tree(root: Path, body: str) -> Path:
    src = root / "csrc"
    src.mkdir(parents=True)
    (src / "tiny.cpp").write_text(_TINY + body)
    (src / "tiny.h").write_text("// header\n")
    return src


def test_build_folder_is_keyed_by_source_contents_not_location(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, a_copy = _tree(tmp_path / "a", "// a\n"), _tree(tmp_path / "copy_of_a", "// a\n")
    b = _tree(tmp_path / "b", "// b\n")
    sa, sb = _build.read_sources(str(a)), _build.read_sources(str(b))
    assert sorted(sa) == ["tiny.cpp", "tiny.h"]
    folder = _build.build_directory("txl_x", sa)
    assert Path(folder).parent == tmp_path / "ext"
    assert Path(folder).name == f"txl_x-{_build.build_key(sa)}"
    assert _build.build_directory("txl_x", _build.read_sources(str(a_copy))) == folder
    assert _build.build_directory("txl_x", sb) != folder
    (b / "tiny.h").write_text("// another header\n")  # headers count too
    assert _build.build_key(_build.read_sources(str(b))) != _build.build_key(sb)
    assert _build.build_directory("txl_y", sa) != folder  # the name is kept apart


@pytest.mark.parametrize("change", ["torch version", "torch CUDA version", "Python ABI"])
def test_build_key_changes_with_torch_python_and_cuda(monkeypatch, change):
    sources = {"x.cpp": b"int x;"}
    before = _build.build_key(sources)
    if change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    elif change == "torch CUDA version":
        monkeypatch.setattr(torch.version, "cuda", None if torch.version.cuda else "12.8")
    else:
        real = _build.sysconfig.get_config_var
        monkeypatch.setattr(_build.sysconfig, "get_config_var",
                            lambda k: ".cpython-399-x.so" if k == "EXT_SUFFIX" else real(k))
    assert _build.build_key(sources) != before
    monkeypatch.undo()
    assert _build.build_key(sources) == before


def _build_in_new_process(src: Path, name: str, ext_dir: Path):
    code = (f"from txl_kernels import _build; _build.csrc_dir = lambda: {str(src)!r}; "
            f"print(_build.compile_extension({name!r}, False).__file__)")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return Path(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.slow  # three new processes, each importing torch and compiling
def test_two_installs_keep_their_own_builds(tmp_path):
    """Two source trees with different contents (an editable checkout and a wheel of another
    version), each built in a new process as two installs would: each gets its own folder and
    library; a third install with the first tree's contents at another path loads the first
    build, compiling nothing (its objects and library are untouched)."""
    ext = tmp_path / "ext"
    name = f"txl_two_{os.getpid()}"
    lib_a, err = _build_in_new_process(_tree(tmp_path / "a", "// a\n"), name, ext)
    assert "compiling the extension" in err
    built_a = {p: p.stat().st_mtime_ns for p in lib_a.parent.rglob("*.[os]*") if p.is_file()}
    assert len(built_a) >= 2, built_a  # the object and the library
    lib_b, err = _build_in_new_process(_tree(tmp_path / "b", "// b\n"), name, ext)
    assert "compiling the extension" in err
    assert lib_a.parent != lib_b.parent and lib_a.parent.parent == lib_b.parent.parent == ext
    lib_c, err = _build_in_new_process(_tree(tmp_path / "c", "// a\n"), name, ext)
    assert lib_c == lib_a and "compiling" not in err, err
    assert {p: p.stat().st_mtime_ns for p in built_a} == built_a, "the first build was redone"
