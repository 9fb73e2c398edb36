"""python -m txl_kernels: the report runs, --help documents every option in plain text, a
backend that disagrees with the reference (or an LM cache path that disagrees with the mems
path) makes it exit non-zero, a bad --device is one line and exit status 2, and the Triton interpreter is
switched on explicitly (never by importing the module). Also: TRITON_INTERPRET set
after the kernels were created is detected (fused_available does not claim the fused
path)."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import txl_kernels.__main__ as main_mod
import txl_kernels.ops.rel_attn_fwd as op

ROOT = Path(__file__).resolve().parents[1]


def test_help_explains_every_option_in_plain_text(capsys):
    parser = main_mod.build_parser()
    undocumented = [a.option_strings for a in parser._actions if not (a.help or "").strip()]
    assert not undocumented, f"options without help text: {undocumented}"
    with pytest.raises(SystemExit) as exc:
        main_mod.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out, out
    assert "python -m tools.build_check" in out and "--no-interpret" in out


def test_main_job_fails_when_the_lm_paths_disagree(monkeypatch, capsys):
    """The LM section compares the K/V cache with the mems path: a cache path that drifts makes
    the command fail."""
    from txl_kernels.models import MemTransformerLM

    real = MemTransformerLM.forward

    def drifting(self, data, target, *mems, cache=None):
        out = real(self, data, target, *mems, cache=cache)
        return [out[0] + 1e-3] + out[1:] if cache is not None else out

    monkeypatch.setattr(MemTransformerLM, "forward", drifting)
    assert main_mod._lm_report(torch.device("cpu"), "cpu") is False
    assert "DISAGREE" in capsys.readouterr().out


def test_main_job_fails_when_a_backend_disagrees(monkeypatch, capsys):
    real = op.rel_attn_fwd

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 0.1, lse

    monkeypatch.setattr(op, "rel_attn_fwd", wrong)
    # the LM section is not under test here, and a smaller layer check fails alike (the
    # interpreter's time goes with the shape)
    monkeypatch.setattr(main_mod, "_lm_report", lambda device, attn_backend: True)
    monkeypatch.setitem(main_mod.SHAPES, "cpu", dict(qlen=8, mlen=8, bsz=1))
    assert main_mod.main(["--no-build"]) == 1
    assert "FAILED: triton: does not agree with the reference" in capsys.readouterr().out


BAD_DEVICES = [("xyz", "is not a torch device"), ("meta", "runs on cpu or cuda tensors")]
if not torch.cuda.is_available():
    BAD_DEVICES.append(("cuda", "no CUDA device is visible"))


@pytest.mark.parametrize("device,reason", BAD_DEVICES, ids=[d for d, _ in BAD_DEVICES])
def test_bad_device_is_one_line_and_exit_2(device, reason, capsys):
    assert main_mod.main(["--device", device, "--no-build"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and reason in lines[0] and device in lines[0], captured.err


def _run(code: str, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_bad_device_exit_status_of_the_command():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "txl_kernels", "--device", "xyz"], cwd=ROOT,
                       env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m txl_kernels: error: --device 'xyz' is not a torch device (expected cpu or "
        "cuda[:N])"], r.stderr


def test_importing_main_sets_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(main_mod)
    assert "TRITON_INTERPRET" not in os.environ


def test_main_switches_the_interpreter_on_explicitly_for_cpu():
    r = _run("import torch\n"
             "from txl_kernels import __main__ as m, _utils, fused_available\n"
             "print(m._interpreter(torch.device('cpu'), True))\n"
             "import txl_kernels.ops.rel_attn_fwd\n"
             "print(_utils.interpreting(), fused_available(torch.device('cpu'))[0])\n")
    said, state = r.stdout.strip().splitlines()
    assert said.startswith("on: set TRITON_INTERPRET=1 here"), said
    assert state == "True True"


def test_interpreter_set_after_the_kernels_exist_is_detected():
    """The kernels were created compiled; setting TRITON_INTERPRET later does
    not make them interpreted, and fused_available says so instead of claiming the CPU path."""
    r = _run("import os, torch\n"
             "from txl_kernels import __main__ as m, _utils, fused_available\n"
             "print(m._interpreter(torch.device('cpu'), False))\n"
             "import txl_kernels.ops.rel_attn_fwd\n"
             "os.environ['TRITON_INTERPRET'] = '1'\n"
             "print(_utils.interpreting())\n"
             "print(fused_available(torch.device('cpu')))\n"
             "print(m._interpreter(torch.device('cpu'), True))\n")
    off, state, avail, late = r.stdout.strip().splitlines()
    assert off == "off (--no-interpret)"
    assert state == "False"
    assert avail.startswith("(False,") and "set after the Triton kernels were created" in avail
    assert late.startswith("off: TRITON_INTERPRET=1 was set too late"), late
