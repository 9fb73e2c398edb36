"""Ahead-of-time compiles of the default configs for every GPU family (no GPU needed): each
kernel at bf16, head dims 64 and 128, for sm_80, sm_89, sm_90 and sm_100 (``python -m
tools.aot_check --quick --defaults --dtypes bf16 --target ... --spill-budget``): compiles, fits
each target's shared memory, stays within the spill budget (a spill regression fails), and
uses TMA only where the hardware has it. Slow: about 90 compiles (tens of minutes on 2 cores).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_aot_sm90 import _REASON, ROOT, _compile_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=f"AOT compile: {_REASON}")]

TARGETS = ("sm_80", "sm_89", "sm_90", "sm_100")


def test_default_configs_compile_fit_and_stay_within_the_spill_budget(tmp_path):
    from tools import aot_check as A
    from txl_kernels._arch import arch_info

    report_path = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot_check", "--quick", "--defaults", "--dtypes", "bf16",
         "--target", ",".join(TARGETS), "--spill-budget", "--json", str(report_path)],
        cwd=ROOT, env=_compile_env(), capture_output=True, text=True, timeout=7200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"aot_check failed (exit {proc.returncode}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["spill_budget"] and report["defaults_only"]
    results = report["results"]
    for target in TARGETS:
        info = arch_info(int(target[3:]))
        rows = [r for r in results if r["target"] == target]
        kernels = {r["kernel"] for r in rows}
        cap = int(target[3:])
        for names in report["kernels"].values():  # every kernel this target's launches take
            expected = {n for n in names if cap in A.TARGET_KERNELS.get(n, (cap,))}
            assert expected <= kernels, (target, expected - kernels)
        for r in rows:
            assert r["status"] == "OK", r
            assert r["shared"] <= info.max_shared, r
            assert not A.over_spill_budget(r), r
            if not info.tma:  # pointer loads only
                assert r["tma"] == 0 and r["wgmma"] == 0, r
        if info.tma:  # the forward's K / V / r tiles come through TMA descriptors
            fwd = [r for r in rows if r["kernel"] == "_rel_attn_fwd_kernel"
                   and any("flags-on" == c.split()[-1] for c in r["cases"])]
            assert fwd and all(r["tma"] > 0 for r in fwd), fwd
