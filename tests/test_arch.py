"""Per-architecture configuration: the arch table, fused_available's compute-capability check, TMA
only from sm_90 on, and each config family's defaults (no GPU needed: launchers configure for
a compile target on meta tensors, as tools/aot_check does)."""
import pytest
import torch

from txl_kernels import _arch, functional
from txl_kernels._arch import ARCHS, arch_info, compile_target, launch_arch


def test_arch_table_limits():
    kib = 1024
    expected = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}
    for cap, limit in expected.items():
        assert arch_info(cap).max_shared == limit * kib, cap
    assert [c for c, a in ARCHS.items() if a.tma] == [90, 100, 103, 120, 121]
    assert arch_info(89).family == arch_info(86).family == "sm86"
    assert arch_info(110).family == "sm100"  # unknown: the nearest known one below
    with pytest.raises(ValueError, match="below 8.0"):
        arch_info(75)


def test_fused_available_checks_the_compute_capability(monkeypatch):
    monkeypatch.setattr(functional, "interpreting", lambda: False)
    monkeypatch.setattr(functional, "capability_of", lambda device: 75)
    ok, why = functional.fused_available(torch.device("cuda"))
    assert not ok and "7.5" in why and "sm_75" in why and "reference" in why
    monkeypatch.setattr(functional, "capability_of", lambda device: 89)
    ok, why = functional.fused_available(torch.device("cuda"))
    assert ok and "sm_89" in why


def test_auto_takes_the_reference_below_sm80_and_triton_says_why(monkeypatch):
    monkeypatch.setattr(functional, "fused_available",
                        lambda device: (False, _arch.unsupported_reason(70)))
    ts = [torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16),
          torch.randn(3, 1, 16), torch.randn(1, 16), torch.randn(1, 16)]
    functional.rel_attention(*ts, backend="auto")  # reference, no error
    with pytest.raises(RuntimeError, match="sm_70.*below 8.0"):
        functional.rel_attention(*ts, backend="triton")


def test_tma_descriptors_only_from_sm90():
    from txl_kernels.ops._common import descriptors_ok
    t = torch.empty(4, 64, device="meta", dtype=torch.bfloat16)
    for cap, tma in ((80, False), (86, False), (89, False), (90, True), (100, True),
                     (120, True)):
        with compile_target(cap) as info:
            assert launch_arch(t.device) is info
            assert descriptors_ok(t) is tma, cap
    assert launch_arch(torch.device("cpu")) is None  # interpreter: its own configs


def test_backward_defaults_per_family(monkeypatch):
    """Each family's backward default: small tiles off sm_90, and one of the configs the
    autotuner tries for that family (in the GPU list, kept by the pruning)."""
    from txl_kernels.ops import rel_attn_bwd as B
    monkeypatch.setattr(B, "INTERPRET", False)
    gpu = {(c.kwargs["BLOCK"], c.num_warps, c.num_stages): c for c in B._configs()}
    for cap, fam in ((80, "sm80"), (89, "sm86"), (90, "sm90"), (100, "sm100"), (120, "sm120")):
        for d in (64, 128, 256):
            for extra in (False, True):
                cfg = B._default_config(d, False, False, fam, extra_tiles=extra)
                if fam != "sm90":
                    assert cfg["BLOCK"] <= 32, (fam, d, cfg)
                key = (cfg["BLOCK"], cfg["num_warps"], cfg["num_stages"])
                assert key in gpu, (fam, d, cfg)
                with compile_target(cap):
                    k = torch.empty(1, dtype=torch.bfloat16, device="meta")
                    kept = B._make_prune(extra)(list(gpu.values()), {"K": k}, BLOCK_D=d)
                assert gpu[key] in kept, (fam, d, extra, cfg)
    assert B._default_config(64, False, family="sm90") == B._default_config(64, False)


def test_forward_tables_fit_the_small_blocks():
    from txl_kernels.ops import rel_attn_fwd as F
    for fam in ("sm86", "sm120"):
        assert F._family_table(fam) and all(row[3] <= 2 for row in F._family_table(fam))
    assert F._family_table("sm90") is F._CONFIG_TABLE
    # every family's default is in the autotuner's configs (the prune keeps it)
    rows = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            for c in F._all_configs()}
    for fam in ("sm80", "sm86", "sm90", "sm100", "sm120"):
        for d in (64, 128):
            for dense_mask in (False, True):
                cfg = F._default_config(d, False, False, fam, dense_mask=dense_mask)
                key = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
                assert key in F._family_table(fam) and key in rows, (fam, d, cfg)
                assert F._config_ok(*key, d, False, False), (fam, d, cfg)
    # the 32-row tiles (spill-free on the mma.sync families) are not tried on sm_90 / sm_100,
    # and 16-bit 32-row tiles take 8 warps
    assert all(row[0] >= 64 or row[2] == 4 for row in F._family_table("sm90"))
    assert not F._config_ok(32, 32, 4, 2, 64, False)
    assert F._default_config(64, False, family="sm90")["BLOCK_M"] == 128


def test_aot_check_parses_targets():
    from tools import aot_check as A
    assert A.parse_targets("sm_80,89") == (80, 89)
    assert A.parse_targets("all") == (80, 89, 90, 100, 120)
    with pytest.raises(ValueError):
        A.parse_targets("sm_75")


def test_spill_budget_rule(monkeypatch):
    from tools import aot_check as A
    monkeypatch.setattr(A, "SPILL_RECORDED", {})
    fwd = {"status": "OK", "default": True, "module": "txl_kernels.ops.rel_attn_fwd",
           "kernel": "_rel_attn_fwd_kernel", "target": "sm_80",
           "cases": ["bf16 D64 flags-on"], "spill_stores": 8, "spill_loads": 4}
    bwd = dict(fwd, module="txl_kernels.ops.rel_attn_bwd", kernel="_rel_attn_bwd_dq_kernel",
               spill_stores=64, spill_loads=64)
    assert A.over_spill_budget(fwd)  # the forward may not spill
    assert not A.over_spill_budget(bwd)  # the backward: up to 64 B
    assert A.over_spill_budget(dict(bwd, spill_loads=65))
    assert not A.over_spill_budget(dict(fwd, default=False))  # autotune-only configs: no budget
    assert not A.over_spill_budget(dict(fwd, cases=["fp16 D64 flags-on"]))
    assert not A.over_spill_budget(dict(fwd, cases=["bf16 D256 flags-on"]))
    # a target that does not meet the goal yet is bound by its recorded figure
    monkeypatch.setitem(A.SPILL_RECORDED, ("sm_80", "_rel_attn_fwd_kernel", 64), 100)
    assert not A.over_spill_budget(dict(fwd, spill_stores=100))
    assert A.over_spill_budget(dict(fwd, spill_stores=101))
    assert A.over_spill_budget(dict(fwd, target="sm_89", spill_stores=100))
    lines, ok = A._summary([dict(fwd, config="c", key="k")],
                           {"txl_kernels.ops.rel_attn_fwd": ["_rel_attn_fwd_kernel"]}, [], {},
                           spill_budget=True)
    assert ok  # within the recorded 100 B
    lines, ok = A._summary([dict(fwd, config="c", key="k", target="sm_89")],
                           {"txl_kernels.ops.rel_attn_fwd": ["_rel_attn_fwd_kernel"]}, [], {},
                           spill_budget=True)
    assert not ok and any("over its 0B budget" in ln for ln in lines), lines
