"""The C++/CUDA sources ship inside the package (wheel), nothing is compiled at install, the
developer tools in tools/ are not packaged, and the main job runs fully from an installed wheel
outside the source tree, printing no warning."""
import os
import re
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_source_tree = pytest.mark.skipif(not (ROOT / "setup.py").exists(),
                                       reason="needs the source tree")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The project's wheel, built once for this file (no build isolation: nothing to fetch)."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(out), "-q"],
        capture_output=True, text=True, cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("txl_kernels-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _requirements(whl: Path):
    meta = next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(whl).read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


@needs_source_tree
def test_wheel_requires_numpy(wheel):
    """torch warns "Failed to initialize NumPy" where numpy is missing, and the Triton
    interpreter (the CPU path of the main job) imports it: it is a dependency, not only a test
    extra's."""
    names = {re.split(r"[<>=!~ ;\[]", r, 1)[0].lower() for r in _requirements(wheel)}
    assert {"torch", "triton", "ninja", "numpy"} <= names, names


@needs_source_tree
def test_wheel_ships_csrc_and_compiles_nothing(wheel):
    # a pure-Python wheel: no compiled extension inside, and platform-independent
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    assert sources, "csrc/ has no sources"
    for name in sources:
        assert f"txl_kernels/csrc/{name}" in names, f"{name} missing from the wheel"
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    for mod in ("functional.py", "reference.py", "ops/rel_attn_fwd.py", "ops/rel_attn_bwd.py",
                "modules/transformer_xl.py", "modules/conformer.py", "memory.py", "_build.py"):
        assert f"txl_kernels/{mod}" in names
    # the developer tools (private Triton APIs, the build report) stay in the source tree
    assert not [n for n in names if n.startswith("tools/") or "aot_check" in n
                or "build_check" in n], names


def test_installed_triton_is_the_pinned_tested_range():
    """pyproject pins the one Triton minor the kernels are tested with; the tests must run on it
    (a wider pin, or a test run on another Triton, would ship an untested combination)."""
    import triton

    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"triton>=(\d+)\.(\d+)(?:\.\d+)?,<(\d+)\.(\d+)"', text)
    assert m, "pyproject.toml must pin triton as >=X.Y,<X.Z"
    lo, hi = (int(m.group(1)), int(m.group(2))), (int(m.group(3)), int(m.group(4)))
    have = tuple(int(x) for x in triton.__version__.split(".")[:2])
    assert lo <= have < hi, f"triton {triton.__version__} is outside the pinned range {m.group(0)}"


@needs_source_tree
@pytest.mark.slow  # a new environment, then the whole main job (and a first extension build)
def test_main_job_runs_from_an_installed_wheel(wheel, tmp_path):
    """A user's install: the wheel in a fresh virtual environment (torch and the other
    dependencies from this machine's site-packages: nothing is downloaded), then
    ``python -m txl_kernels`` from an empty folder outside the source tree. Every section runs
    (the LM's included), the package comes from the wheel, and nothing warns."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True)
    py = str(venv / "bin" / "python")
    # --system-site-packages reaches the base interpreter's packages only: when these tests
    # run in a virtual environment themselves (CI's), its site-packages come after the new
    # environment's own, so the wheel's txl_kernels is found first
    site_dir = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
    Path(site_dir, "outer_env.pth").write_text(
        f"import site; [site.addsitedir(d) for d in {site.getsitepackages()!r}]\n")
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--ignore-installed", str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    where = subprocess.run([py, "-c", "import txl_kernels; print(txl_kernels.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    proc = subprocess.run([py, "-m", "txl_kernels"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=1800)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    assert "OK: every usable backend agrees with the reference" in out, out
    lm = out[out.index("Transformer-XL LM"):]
    assert "skipped" not in lm and ": agree" in lm and "same tokens" in lm, lm
    assert "extension                    loaded" in out, out
    assert not re.search(r"warn|numpy", err, re.I), err


# the jobs that take minutes on a 2-core machine: out of the README's test command, run by CI
SLOW_JOBS = [
    "tests/test_aot_sm90.py::test_quick_aot_check_compiles_every_kernel",
    "tests/test_aot_sm90.py::test_checker_reports_broken_kernels_as_fail",
    "tests/test_build.py::test_check_cuda_compiles_the_cuda_sources",
    "tests/test_build.py::test_two_installs_keep_their_own_builds",
    "tests/test_examples.py::test_ddp_and_fsdp_equal_one_process_with_the_whole_batch[reference]",
    "tests/test_examples.py::test_fsdp_emits_no_view_warning",
    "tests/test_interpreter_speed.py::test_kernel_tests_pass_under_the_overflow_sanitizer",
    "tests/test_packaging.py::test_main_job_runs_from_an_installed_wheel",
    "tests/test_training.py::test_fused_and_reference_train_identically",
]


@needs_source_tree
def test_readme_test_command_leaves_the_slow_jobs_to_ci():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^(pytest tests/ .*)$", readme, re.M)
    assert m, "README.md shows no test command"
    command = m.group(1)
    assert '-m "not slow"' in command, command
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^pytest tests/ -m "not slow"', ci, re.M), "CI runs the README command"
    assert re.search(r"^pytest tests/ -m slow", ci, re.M), "CI runs the slow tests"
    files = sorted({job.split("::")[0] for job in SLOW_JOBS})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slow = set(proc.stdout.split())
    assert not [job for job in SLOW_JOBS if job not in slow], proc.stdout
    assert "PytestUnknownMarkWarning" not in proc.stdout + proc.stderr  # registered
