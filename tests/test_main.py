"""python -m txl_kernels: the report runs, and a backend that disagrees with the reference makes
it exit non-zero."""
import pytest

import txl_kernels.__main__ as main_mod

pytest.importorskip("txl_kernels.ops", reason="fused kernels not importable")


def test_main_job_passes(capsys):
    assert main_mod.main(["--no-build"]) == 0
    out = capsys.readouterr().out
    assert "backends" in out and "reference" in out and "triton" in out
    assert "OK: every usable backend agrees" in out


def test_main_job_fails_when_a_backend_disagrees(monkeypatch, capsys):
    import txl_kernels.ops.rel_attn_op as op

    real = op.rel_attn_fwd

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 0.1, lse

    monkeypatch.setattr(op, "rel_attn_fwd", wrong)
    assert main_mod.main(["--no-build"]) == 1
    assert "FAILED: triton: does not agree with the reference" in capsys.readouterr().out
