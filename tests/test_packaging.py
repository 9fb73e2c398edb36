"""The C++/CUDA sources ship inside the package (wheel), nothing is compiled at install, and the
developer tools in tools/ are not packaged."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="needs the source tree")
def test_wheel_ships_csrc_and_compiles_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), "-q"],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(tmp_path.glob("txl_kernels-*.whl"))
    assert len(wheels) == 1
    # a pure-Python wheel: no compiled extension inside, and platform-independent
    assert wheels[0].name.endswith("-py3-none-any.whl"), wheels[0].name
    names = zipfile.ZipFile(wheels[0]).namelist()
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
    import re

    import triton

    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"triton>=(\d+)\.(\d+)(?:\.\d+)?,<(\d+)\.(\d+)"', text)
    assert m, "pyproject.toml must pin triton as >=X.Y,<X.Z"
    lo, hi = (int(m.group(1)), int(m.group(2))), (int(m.group(3)), int(m.group(4)))
    have = tuple(int(x) for x in triton.__version__.split(".")[:2])
    assert lo <= have < hi, f"triton {triton.__version__} is outside the pinned range {m.group(0)}"
