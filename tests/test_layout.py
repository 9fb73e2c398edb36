"""README.md's Layout section names every source file of the package, csrc/ and tools/."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources():
    try:
        out = subprocess.run(["git", "ls-files", "txl_kernels", "csrc", "tools"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.split() if re.search(r"\.(py|cpp|h|cu)$", p)]


def test_readme_layout_names_every_source_file():
    text = open(os.path.join(ROOT, "README.md")).read()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    words = set(re.findall(r"[\w./]+", layout))
    missing = []
    for path in _sources():
        name = os.path.basename(path)
        folder = os.path.dirname(path).split("/")[-1]
        named = path in words or name in words or f"{folder}/{name}" in words
        if not named and name.endswith(".h"):  # a header given as ".h" beside its .cpp
            named = name[:-2] + ".cpp" in words and ".h" in words
        if not named:
            missing.append(path)
    assert not missing, f"README.md's Layout does not name {missing}"
