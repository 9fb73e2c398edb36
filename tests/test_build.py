"""txl_kernels._build: the JIT builder of the C++/CUDA extension (issue 2, points 5 and 8).

The report, the cache location (TORCH_EXTENSIONS_DIR), clear reasons when the extension cannot
be built (no ninja, no compiler), CUDA_HOME detection through an nvcc wrapper script, and
``python -m txl_kernels._build --check-cuda``: it compiles and links the CUDA sources without a
GPU, and fails, showing the compiler output, when a source is broken.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from txl_kernels import _build

REPORT_KEYS = ["torch", "torch CUDA runtime", "CUDA device", "triton", "nvcc", "CUDA_HOME",
               "ninja", "C++ compiler", "TORCH_EXTENSIONS_DIR", "extension sources", "extension",
               "extension CUDA kernel"]

HAVE_TOOLKIT = torch.version.cuda is not None and _build.find_cuda_home()[0] is not None
requires_toolkit = pytest.mark.skipif(
    not HAVE_TOOLKIT or bool(_build.build_problems()),
    reason="needs a CUDA build of torch, a CUDA toolkit (nvcc), ninja and a C++ compiler")


@pytest.fixture
def fresh_state(monkeypatch):
    """A build state as in a new process (restored afterwards)."""
    st = _build._State()
    monkeypatch.setattr(_build, "_STATE", st)
    return st


def test_report_has_the_expected_keys_and_builds_nothing(fresh_state):
    rows = _build.build_report()
    assert [k for k, _ in rows] == REPORT_KEYS
    assert all(isinstance(v, str) and v for _, v in rows)
    report = dict(rows)
    assert torch.__version__ in report["torch"]
    assert report["torch CUDA runtime"] == (torch.version.cuda or "none (not a CUDA build)")
    assert report["CUDA device"] == "none visible" or torch.cuda.is_available()
    if HAVE_TOOLKIT:
        home = _build.find_cuda_home()[0]
        assert report["CUDA_HOME"].startswith(home)
        assert "release" in report["nvcc"]
    assert not fresh_state.attempted, "build_report must not build the extension"


def test_extensions_dir_respects_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _build.extensions_root() == str(tmp_path)
    assert _build.build_directory(_build.EXT_NAME) == str(tmp_path / _build.EXT_NAME)
    assert _build.build_directory(_build.EXT_NAME_CUDA) == str(tmp_path / _build.EXT_NAME_CUDA)
    assert dict(_build.build_report())["TORCH_EXTENSIONS_DIR"].startswith(str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    default = _build.extensions_root()
    assert default.startswith(cpp_extension.get_default_build_root())


def test_loaded_extension_lives_in_the_cache_dir():
    mod = _build.load_extension()
    st = _build.extension_status()
    if mod is None:
        if st["buildable"]:
            pytest.fail(f"the extension should build here: {st['reason']}\n{st['log']}")
        pytest.skip(st["reason"])
    assert Path(mod.__file__).parent == Path(_build.build_directory(st["name"]))
    assert st["loaded"] and st["reason"].startswith("loaded")
    assert _build.load_extension() is mod, "built (and loaded) once per process"


def test_missing_ninja_gives_a_clear_reason(monkeypatch, tmp_path, fresh_state):
    monkeypatch.setenv("PATH", str(tmp_path))          # no ninja (nor anything else) on PATH
    monkeypatch.setattr(_build, "_extra_ninja_dirs", lambda: [])  # and none in the venv
    assert _build.find_ninja() is None
    assert any("ninja was not found" in p for p in _build.build_problems())
    assert _build.load_extension() is None
    st = _build.extension_status()
    assert st["attempted"] and not st["loaded"] and not st["buildable"]
    assert "cannot build the C++ extension" in st["reason"] and "ninja" in st["reason"]
    assert dict(_build.build_report())["ninja"].startswith("not found")


def test_ninja_outside_path_is_found_and_put_on_path(monkeypatch, tmp_path):
    bindir = tmp_path / "venv-bin"
    bindir.mkdir()
    fake = bindir / "ninja"
    fake.write_text("#!/bin/sh\necho 1.11.1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(_build, "_extra_ninja_dirs", lambda: [str(bindir)])
    assert _build.find_ninja() == str(fake)
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bindir)


def test_missing_compiler_gives_a_clear_reason(monkeypatch, fresh_state):
    monkeypatch.setenv("CXX", "/nonexistent/g++-42")
    assert any("no C++ compiler" in p and "g++-42" in p for p in _build.build_problems())
    assert _build.load_extension() is None
    assert "no C++ compiler" in _build.extension_status()["reason"]


def _fake_toolkit(root: Path, major: str) -> Path:
    home = root / "cuda-fake"
    (home / "include").mkdir(parents=True)
    (home / "bin").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("// fake\n")
    (home / "include" / "cuda_runtime_api.h").write_text(
        f"#define CUDART_VERSION {int(major) * 1000}\n")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.9, V99.9.1'\n")
    nvcc.chmod(0o755)
    return home


def test_cuda_home_found_through_an_nvcc_wrapper(monkeypatch, tmp_path):
    """torch guesses CUDA_HOME = dirname(dirname(which nvcc)); a wrapper script in
    <prefix>/bin makes that <prefix>, which has no CUDA headers. The builder follows the
    wrapper to the real toolkit and tells torch."""
    major = (torch.version.cuda or "12.0").split(".")[0]
    home = _fake_toolkit(tmp_path, major)
    wrapper_dir = tmp_path / "local" / "bin"
    wrapper_dir.mkdir(parents=True)
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    monkeypatch.setattr(_build, "_CONFIGURED", None)
    found, how = _build.find_cuda_home()
    assert found == str(home), how
    assert "wrapper" in how
    # a CUDA_HOME without headers is not trusted
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "local"))
    found, how = _build.find_cuda_home()
    assert found == str(home) and "has no include/cuda_runtime.h" in how
    # configure_cuda_home tells torch (module global read at build time) and the environment
    assert _build.configure_cuda_home() == str(home)
    assert os.environ["CUDA_HOME"] == str(home)
    assert cpp_extension.CUDA_HOME == str(home)
    assert "wrapper" in _build.cuda_home_info()[1]


def test_no_toolkit_means_a_cpu_only_build_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(_build, "find_cuda_home",
                        lambda: (None, "no CUDA toolkit in: /nowhere"))
    ok, why = _build.cuda_build_plan(require_device=False)
    if torch.version.cuda is None:
        assert not ok and "not a CUDA build" in why
    else:
        assert not ok and "no CUDA toolkit (nvcc) found" in why and "/nowhere" in why


def test_arch_flags():
    assert _build._arch_flags_without_device("8.0;9.0+PTX") == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]
    with pytest.raises(ValueError, match="cannot parse"):
        _build._arch_flags_without_device("hopper")


def _run_check_cuda(env_extra, pythonpath=None, timeout=900):
    env = dict(os.environ, **env_extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "txl_kernels._build", "--check-cuda", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=pythonpath or None)


@requires_toolkit
def test_check_cuda_compiles_the_cuda_sources():
    """What CI runs: compile + link (and import, where possible) the CUDA build. Uses the
    normal extension cache, so after CI's own --check-cuda run this is a no-op build."""
    r = _run_check_cuda({})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "check-cuda: OK" in out


@requires_toolkit
def test_check_cuda_fails_on_a_broken_cuda_source(tmp_path):
    """A broken .cu makes --check-cuda exit 1 and show the compiler's error."""
    pkg = Path(_build.__file__).resolve().parent
    src = _build.csrc_dir()
    shutil.copytree(pkg, tmp_path / "txl_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    shutil.copytree(src, tmp_path / "csrc")
    cu = tmp_path / "csrc" / "segment_memory_cuda.cu"
    text = cu.read_text()
    assert "const int64_t rows = L.n * L.bsz;" in text
    cu.write_text(text.replace("const int64_t rows = L.n * L.bsz;",
                               "const int64_t rows = L.n * L.bsz + txl_broken_symbol;"))
    # MAX_JOBS=1: ninja compiles the .cu first and stops at its error (no parallel .cpp build)
    r = _run_check_cuda({"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MAX_JOBS": "1"},
                        str(tmp_path))
    out = r.stdout + r.stderr
    assert f"extension sources: {tmp_path / 'csrc'}" in out, out  # compiled the broken copy
    assert r.returncode == 1, out
    assert "check-cuda: FAILED" in out and "txl_broken_symbol" in out, out
