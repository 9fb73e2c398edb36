"""The CPU kernel's benchmark suite: its providers compute the reference's function, its matrix
holds the issue's shapes, dense baselines that cannot fit are skipped up front (and the
estimate behind that is an upper bound), the target ratios are computed right, and the memory
and long-audio scripts run end to end at tiny sizes. No timing is asserted anywhere."""

import pytest
import torch

from test_bench_providers import BASELINE_FACTOR, CONFIGS, _check_against_reference

from benchmarks import cpu_memory, cpu_suite, long_audio, runner, shapes
from benchmarks import providers as P

GiB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# Providers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"B{c[0]}q{c[1]}m{c[2]}H{c[3]}D{c[4]}")
def test_nemo_eager_matches_reference(cfg, dtype):
    _check_against_reference(P.nemo_eager, cfg, dtype, factor=BASELINE_FACTOR)


def test_nemo_eager_rejects_too_few_position_rows():
    inp = P.make_attn_inputs(shapes.AttnShape("t", 1, 2, 16, 6, 0, False, False, (), "cpu"),
                             "fp32", "cpu")
    inp.r = inp.r[:5]
    with pytest.raises(ValueError, match="R >= Lk"):
        P.nemo_eager(inp)


def test_cpu_fused_names_a_missing_backend(monkeypatch):
    monkeypatch.setenv(P.CPU_BACKEND_ENV, "no_such_backend")
    reason = P.cpu_fused_unavailable()
    assert reason and "no_such_backend" in reason and "backends:" in reason
    assert P.skip_reason(P.CPU_ATTN_PROVIDERS["cpu_fused"], "cpu") == reason


def test_cpu_fused_stands_in_with_another_backend(monkeypatch):
    monkeypatch.setenv(P.CPU_BACKEND_ENV, "reference")
    assert P.cpu_fused_unavailable() is None
    _check_against_reference(P.cpu_fused, CONFIGS[1], torch.float32)


def test_cpu_fused_provider_matches_reference():
    """The provider as timed (backend="cpu") computes the reference's function, forward and
    every gradient; where this txl_kernels has no CPU kernel the reason is the skip."""
    reason = P.cpu_fused_unavailable()
    if reason:
        pytest.skip(reason)
    for cfg in CONFIGS:
        _check_against_reference(P.cpu_fused, cfg, torch.float32)


# ---------------------------------------------------------------------------------------------
# The matrix


def test_issue_matrix_has_the_issue_shapes():
    cases = shapes.cpu_kernel_cases("issue")
    threads = shapes.cpu_thread_counts()
    conf = [c for c in cases if c.group == "cpu_conformer"]
    txl = [c for c in cases if c.group == "cpu_txl"]
    for c in conf:
        s = c.shape
        assert (s.B, s.H, s.D, s.mem, s.causal, s.key_padding) == (1, 8, 64, 0, False, False)
        assert s.R == 2 * s.Lq - 1 and c.dtype == "fp32"
    got = {(c.shape.Lq, c.shape.threads, c.mode) for c in conf}
    for t in threads:
        for T in (1024, 4096, 16384):
            assert (T, t, shapes.FWD) in got
        for T in (1024, 4096):
            assert (T, t, shapes.FWD_BWD) in got
    assert (16384, threads[-1], shapes.FWD_BWD) in got
    for c in txl:
        s = c.shape
        assert (s.B, s.H, s.D, s.causal, s.R, c.mode) == (10, 10, 41, True, s.Lk, shapes.FWD)
    assert {(c.shape.Lq, c.shape.mem, c.shape.threads) for c in txl} == {
        (q, m, t) for q, m in ((64, 640), (128, 1600)) for t in threads}
    assert len({c.key for c in cases}) == len(cases)
    full = {(c.shape.Lq, c.shape.threads, c.mode) for c in shapes.cpu_kernel_cases("full")
            if c.group == "cpu_conformer"}
    assert full == {(T, t, m) for T in (1024, 4096, 16384) for t in threads for m in shapes.MODES}


def test_cpu_kernel_size_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(shapes.CPU_KERNEL_ENV, raising=False)
    assert shapes.cpu_kernel_size() == "small"
    assert max(c.shape.Lq for c in shapes.cpu_kernel_cases()) <= 256
    monkeypatch.setenv(shapes.CPU_KERNEL_ENV, "issue")
    assert shapes.cpu_kernel_size() == "issue"
    monkeypatch.setenv(shapes.CPU_KERNEL_ENV, "huge")
    with pytest.raises(ValueError, match="TXL_BENCH_CPU_KERNEL must be one of"):
        shapes.cpu_kernel_size()


def test_dense_baselines_get_fewer_rounds_on_long_shapes():
    long4k = next(c.shape for c in shapes.cpu_kernel_cases("issue") if c.shape.Lq == 4096)
    assert shapes.rounds_for(long4k, "cpu_fused", "issue") == long4k.rounds
    assert shapes.rounds_for(long4k, "reference", "issue") < long4k.rounds
    txl = next(c.shape for c in shapes.cpu_kernel_cases("issue") if c.group == "cpu_txl")
    assert shapes.rounds_for(txl, "reference", "issue") == txl.rounds


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_suite, "cpu_flags", lambda: ("avx2", "fma"))
    native, why = cpu_suite.native_bf16()
    assert not native and "avx512_bf16" in why and "avx2" in why
    monkeypatch.delenv(shapes.CPU_BF16_ENV, raising=False)
    assert not cpu_suite.bf16_wanted()[0]
    monkeypatch.setenv(shapes.CPU_BF16_ENV, "1")
    assert cpu_suite.bf16_wanted()[0]
    monkeypatch.setattr(cpu_suite, "cpu_flags", lambda: ("avx512f", "amx_bf16"))
    assert cpu_suite.native_bf16() == (True, "native bf16: the CPU has amx_bf16")


# ---------------------------------------------------------------------------------------------
# Memory: which baseline fits


def _conformer_case(T, mode=shapes.FWD, dtype="fp32"):
    s = shapes.CpuAttnShape("cpu_conformer", 1, 8, 64, T, 0, False, False, (mode,), "cpu")
    return shapes.Case("cpu_attention", s, dtype, mode)


def test_memory_skip_at_the_issue_lengths():
    avail = 21 * GiB  # what a 24 GB machine has free
    for name in shapes.DENSE_PROVIDERS:
        for mode in shapes.MODES:
            reason = cpu_suite.memory_skip_reason(_conformer_case(16384, mode), name, avail)
            assert reason and "GiB" in reason and "16384" in reason, name
            assert cpu_suite.memory_skip_reason(_conformer_case(4096, mode), name, avail) \
                is None
    for name in ("cpu_fused", "sdpa_plain"):
        assert cpu_suite.dense_bytes(_conformer_case(16384), name) == 0
        assert cpu_suite.memory_skip_reason(_conformer_case(1 << 20), name, avail) is None


def test_runner_skips_a_dense_baseline_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(cpu_suite, "mem_available_bytes", lambda: 2 ** 20)
    case = _conformer_case(64)
    rec = runner.run_case(case, "reference", lambda s, t: pytest.fail("must not be timed"))
    assert rec["status"] == "skipped" and "does not fit" in rec["reason"]
    ok = runner.run_case(case, "sdpa_plain", runner.timer_for(0.0))
    assert ok["status"] == "ok" and ok["time_s"] > 0


@pytest.mark.parametrize("mode", shapes.MODES)
@pytest.mark.parametrize("name", shapes.DENSE_PROVIDERS)
def test_dense_estimate_bounds_the_allocations(name, mode):
    """The allocator's peak of one call (torch.profiler) stays under the estimate that decides
    the up-front skip, so a baseline that is run does fit."""
    T = 192
    case = _conformer_case(T, mode)
    inp = P.make_attn_inputs(case.shape, "fp32", "cpu", requires_grad=mode == shapes.FWD_BWD)
    peak = cpu_memory._allocator_peak(P.CPU_ATTN_PROVIDERS[name].fn, inp, mode)
    est = cpu_suite.dense_bytes(case, name)
    unit = 8 * T * T * 4
    assert 3 * unit < peak <= est, (peak / unit, est / unit)


def test_threads_are_set_for_the_run_and_restored():
    before = torch.get_num_threads()
    seen = []
    s = shapes.CpuAttnShape("cpu_conformer", 1, 2, 16, 8, 0, False, False, (shapes.FWD,), "cpu",
                            threads=1)
    case = shapes.Case("cpu_attention", s, "fp32", shapes.FWD)

    def timer(step, device):
        seen.append(torch.get_num_threads())
        return runner.measure(step, device, 0.0)

    rec = runner.run_case(case, "sdpa_plain", timer, warmup=0)
    assert rec["status"] == "ok" and seen == [1] and torch.get_num_threads() == before
    assert "1 thread" in rec["label"]


# ---------------------------------------------------------------------------------------------
# The targets


def _rec(provider, t, key="k", group="cpu_conformer", mode=shapes.FWD, status="ok", reason=""):
    return dict(kind="cpu_attention", key=key, group=group, label="B1 T1024 1 thread",
                dtype="fp32", mode=mode, provider=provider, status=status, reason=reason,
                time_s=t, reps=3)


def test_target_rows():
    recs = [_rec("cpu_fused", 0.10), _rec("sdpa_plain", 0.08), _rec("reference", 0.60),
            _rec("nemo_eager", 0.45), _rec("sdpa_bias", None, status="skipped",
                                           reason="does not fit: 43 GiB")]
    rows = {r[4]: r for r in cpu_suite.target_rows(recs)}
    assert set(rows) == {"sdpa_plain", "reference", "nemo_eager", "sdpa_bias"}
    assert rows["sdpa_plain"][6:] == ["time ratio 1.25x", "time ratio <= 1.5x", "met"]
    assert rows["reference"][6:] == ["speed-up 6.00x", "speed-up >= 5x", "met"]
    assert rows["nemo_eager"][6:] == ["speed-up 4.50x", "speed-up >= 5x", "NOT met"]
    assert rows["sdpa_bias"][6] == "" and "does not fit: 43 GiB" in rows["sdpa_bias"][8]
    txl = cpu_suite.target_rows([_rec("cpu_fused", 0.1, "t", "cpu_txl"),
                                  _rec("reference", 0.3, "t", "cpu_txl")])
    assert [r[6:] for r in txl] == [["speed-up 3.00x", "speed-up >= 2x", "met"]]
    text = cpu_suite.summary(recs)
    assert "| cpu_conformer B1 T1024 1 thread | fp32 | fwd |" in text and "CPU:" in text


def test_median_rows_judge_each_target_by_the_median_of_the_runs():
    runs = [[_rec("cpu_fused", t), _rec("sdpa_plain", 0.10), _rec("reference", 0.60)]
            for t in (0.14, 0.16, 0.15)]
    runs[1].append(_rec("nemo_eager", None, status="skipped", reason="does not fit"))
    rows = {r[3]: r for r in cpu_suite.median_rows(runs)}
    assert rows["sdpa_plain"][4:] == ["1.40, 1.60, 1.50", "time ratio 1.50x",
                                      "time ratio <= 1.5x", "met"]
    assert rows["reference"][4:6] == ["4.29, 3.75, 4.00", "speed-up 4.00x"]
    assert rows["reference"][7] == "NOT met"
    assert rows["nemo_eager"][4:] == ["", "", "speed-up >= 5x", "nemo_eager not run"]
    text = cpu_suite.median_summary(runs)
    assert "3 runs, each in a fresh process" in text and "| 1.40, 1.60, 1.50 |" in text


def test_scaling_rows_all_cores_over_one_thread_from_t_4096():
    def rec(threads, T, t):
        return dict(_rec("cpu_fused", t), seqlen=T,
                    series=f"cpu_conformer B1 H8 D64 full {threads}thr fp32 fwd")
    runs = [[rec(1, 4096, 1.0), rec(2, 4096, 0.5), rec(1, 1024, 0.1), rec(2, 1024, 0.09)],
            [rec(1, 4096, 1.0), rec(2, 4096, 0.6)]]
    assert cpu_suite.scaling_rows(runs) == [
        ["cpu_conformer B1 H8 D64 full fp32 fwd T4096, 2 threads vs 1", "2.00, 1.67",
         "speed-up 1.83x", "speed-up >= 1.8x", "met"]]
    assert cpu_suite.scaling_rows([runs[1]])[0][4] == "NOT met"
    assert "all cores over one thread" in cpu_suite.median_summary(runs)


def test_cpu_ratios_children_run_one_process_each():
    from benchmarks import cpu_ratios

    argv = ["--threads", "1", "--proc", "5", "--modes", "fwd"]  # (an abbreviation argparse takes)
    assert cpu_ratios.parser().parse_args(argv).processes == 5
    child = cpu_ratios.parser().parse_args(cpu_ratios.child_argv(argv))
    assert child.processes == 1 and child.emit_json and child.threads == [1]
    assert child.modes == ["fwd"]


# ---------------------------------------------------------------------------------------------
# The scripts, in this process at tiny sizes


def test_cpu_memory_child_measures_one_forward():
    rec = cpu_memory.child("reference", 128, "fp32", torch.get_num_threads(), True)
    assert rec["status"] == "ok" and rec["base_bytes"] > 0
    assert rec["allocator_peak_bytes"] >= 8 * 128 * 128 * 4  # at least one [B, H, T, T] fp32
    text = cpu_memory.table([rec, dict(rec, provider="cpu_fused", extra_bytes=1 << 20)],
                            cpu_memory.parse_args(["--T", "128"]))
    assert "| 128 | reference |" in text and "(measured)" in text


def test_long_audio_frames_and_estimate():
    assert long_audio.encoder_frames(10) == 7500
    # BD [1, 8, 7500, 14999] fp32 and its padded copy (3.6 GB each), the mask and the
    # attention's work (1.8 GB each): 10.8 GB
    assert long_audio.unswapped_attention_bytes(7500, 8) == 8 * 7500 * (2 * 15000 + 2 * 7500) * 4


def test_long_audio_swapped_encoder_agrees_with_the_original():
    pytest.importorskip("transformers.models.parakeet")
    args = long_audio.parse_args(["--hidden", "64", "--heads", "2", "--layers", "1",
                                  "--backend", "reference", "--threads",
                                  str(torch.get_num_threads())])
    recs = [long_audio.child(v, 0.05, args) for v in long_audio.VARIANTS]
    a, b = recs
    assert a["swapped_modules"] == 1 and b["swapped_modules"] == 0
    assert a["T"] == b["T"] == long_audio.encoder_frames(0.05)
    assert long_audio.agreement(a, b) < 1e-4
    assert "outputs agree to" in long_audio.table(recs, args)


def test_long_audio_memory_guard_holds_back_only_the_unswapped_encoder():
    """At an hour of audio (T 45,000) on a 23.5 GiB machine the swapped encoder still runs (its
    attention is O(T)); the unswapped one is held back, and runs where its tensors fit."""
    args = long_audio.parse_args(["--heads", "8"])
    T = long_audio.encoder_frames(60)
    assert T == 45000
    avail = int(23.5 * GiB)
    assert long_audio.memory_skip_reason("swapped", T, args, avail) == ""
    why = long_audio.memory_skip_reason("unswapped", T, args, avail)
    assert "BD [1, 8, 45000, 89999]" in why and "23.5 GiB available" in why
    assert long_audio.memory_skip_reason("unswapped", 750, args, avail) == ""
    assert long_audio.memory_skip_reason("unswapped", T, args, None) == ""


def test_long_audio_memory_linear_line():
    recs = [dict(variant="swapped", minutes=m, T=long_audio.encoder_frames(m), status="ok",
                 extra_bytes=long_audio.encoder_frames(m) * 2 ** 20 * f)
            for m, f in ((10, 1.0), (60, 1.5))]
    recs.append(dict(variant="unswapped", minutes=60, T=45000, status="not run", reason="x"))
    (line,) = long_audio.linearity_lines(recs)
    assert line.startswith("swapped: memory linear in T: extra RSS per 1,000 frames ")
    assert "10 min (T 7500) 1000.0 MiB, 60 min (T 45000) 1500.0 MiB" in line
    assert line.endswith("(extra / T) at 60 min / at 10 min = 1.50")


def test_long_audio_local_attention_reaches_every_block():
    """--attention local sets every swapped block's window: a window covering the sequence gives
    the full-attention encoder's output, a short one another output; the unswapped encoder has
    no local attention."""
    pytest.importorskip("transformers.models.parakeet")
    common = ["--hidden", "64", "--heads", "2", "--layers", "2", "--backend", "reference",
              "--threads", str(torch.get_num_threads())]
    T = long_audio.encoder_frames(0.05)
    full = long_audio.child("swapped", 0.05, long_audio.parse_args(common))
    wide = long_audio.child("swapped", 0.05, long_audio.parse_args(
        common + ["--attention", "local", "--window", str(T), str(T)]))
    short = long_audio.child("swapped", 0.05, long_audio.parse_args(
        common + ["--attention", "local", "--window", "2", "1"]))
    assert wide["attention"] == "local" and wide["window"] == [T, T]
    assert long_audio.agreement(full, wide) < 1e-5
    assert long_audio.agreement(full, short) > 1e-3
    with pytest.raises(ValueError, match="full attention only"):
        long_audio.child("unswapped", 0.05, long_audio.parse_args(
            common + ["--attention", "local"]))


@pytest.mark.slow  # fresh processes of the script (~20 s on two cores)
def test_long_audio_local_mode_end_to_end(capsys):
    """The script in local mode at tiny sizes: fresh processes, the unswapped variant said and
    skipped, time per block, the memory-linear line."""
    pytest.importorskip("transformers.models.parakeet")
    rc = long_audio.main(["--attention", "local", "--window", "4", "4", "--minutes", "0.05",
                          "0.1", "--hidden", "64", "--heads", "2", "--layers", "1", "--backend",
                          "reference", "--threads", "1", "--timeout-s", "120"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "unswapped: not run with --attention local" in out
    assert "local attention, window [4, 4]" in out
    assert out.count("s per block)") == 2
    assert "swapped: memory linear in T: extra RSS per 1,000 frames 0.05 min (T 38)" in out
    assert "(extra / T) at 0.1 min / at 0.05 min = " in out
