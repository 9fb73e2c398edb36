"""The benchmark suite's own correctness: every provider computes the same relative attention
as the reference (forward and every gradient), the FLOP count is exact, the runner records
out-of-memory and goes on, and the report's ratio and table logic works on synthetic records.
No timing is asserted anywhere.

flex runs forward only on CPU (FlexAttention has no CPU backward); its gradients, and the fused
provider, are checked on CUDA only.
"""
import json
import warnings

import pytest
import torch

from helpers import HAS_CUDA, assert_within, make_inputs, oracle, requires_cuda
from txl_kernels.reference import allowed_pairs, rel_attention_reference, rel_shift

from benchmarks import providers as P
from benchmarks import report, results, runner, shapes

# (B, Lq, mem, H, D, causal, key lengths or None): Transformer-XL with memory (R = Lk), a
# Conformer-like padded full attention (R = Lk + Lq - 1), odd sizes, a single query.
CONFIGS = [
    (2, 7, 30, 3, 16, True, None),
    (2, 37, 0, 2, 41, False, (37, 20)),
    (1, 1, 12, 2, 8, True, None),
    (3, 13, 5, 1, 24, False, (18, 1, 9)),
]


def _attn_inputs(cfg, dtype, requires_grad=True, seed=0, zero_pos=False, device="cpu"):
    B, Lq, mem, H, D, causal, lengths = cfg
    Lk = Lq + mem
    R = Lk if causal else Lk + Lq - 1
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, seed=seed,
                                    device=device)
    if zero_pos:
        r, u, vb = torch.zeros_like(r), torch.zeros_like(u), torch.zeros_like(vb)
    ts = [t.detach().requires_grad_(requires_grad) for t in (q, k, v, r, u, vb)]
    kpm = None
    if lengths is not None:
        kpm = torch.arange(Lk, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    return P.AttnInputs(*ts, causal=causal, key_padding_mask=kpm)


def _norm(inp):
    """(softmax_scale, window_left, window_right, kpm, attn_mask) for the reference."""
    return inp.scale, -1, (0 if inp.causal else -1), inp.key_padding_mask, None


# The baselines (SDPA with BD as a float mask, FlexAttention reading a BD table) hold the shifted
# BD tensor in the input dtype, as the code they stand for does; the reference accumulates and
# holds every score in fp32, so at fp16 / bf16 a baseline's error is several times the
# reference's by construction (measured up to about 6x). They are checked to compute the same
# function, not to be as precise as our kernels.
BASELINE_FACTOR = 8.0


def _check_against_reference(fn, cfg, dtype, grads=True, zero_pos=False, factor=3.0,
                             device="cpu"):
    inp = _attn_inputs(cfg, dtype, requires_grad=grads, zero_pos=zero_pos, device=device)
    ts = inp.tensors()
    out = fn(inp)
    scale, wl, wr, kpm, mask = _norm(inp)
    same = rel_attention_reference(*ts, scale, wl, wr, kpm, mask)
    up, truth = oracle(*ts, scale, wl, wr, kpm, mask)
    assert out.shape == truth.shape and out.dtype == inp.q.dtype
    assert_within("out", out.detach(), same.detach(), truth.detach(), factor)
    if not grads:
        return
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    names = ["dq", "dk", "dv", "dr", "du", "dvb"]
    n = 3 if zero_pos else 6  # without position terms only q, k, v matter
    got = torch.autograd.grad(out, ts[:n], g.to(out.dtype), allow_unused=True)
    ref = torch.autograd.grad(same, ts[:n], g.to(same.dtype))
    exact = torch.autograd.grad(truth, up[:n], g.double())
    for name, a, b, c in zip(names, got, ref, exact):
        assert a is not None, f"{name}: no gradient"
        assert_within(name, a, b, c, factor)


# ---------------------------------------------------------------------------------------------
# FLOP convention and the matrix


@pytest.mark.parametrize("Lq,Lk,causal,lengths", [
    (7, 37, True, [37, 30]), (9, 9, True, [9, 1, 4]), (5, 16, False, [16, 3]),
    (12, 12, False, [12]), (1, 40, True, [40, 2]), (6, 8, True, [8, 8]),
])
def test_allowed_pairs_count_is_exact(Lq, Lk, causal, lengths):
    kpm = torch.arange(Lk)[None, :] >= torch.tensor(lengths)[:, None]
    brute = allowed_pairs(Lq, Lk, -1, 0 if causal else -1, kpm, None, torch.device("cpu"))
    assert shapes.allowed_pairs_count(Lq, Lk, causal, lengths) == int(brute.sum())


def test_flop_convention():
    """Triton's tutorial convention: 4 * B * H * Lq * Lk * D forward for plain attention,
    6 * ... for relative attention, backward 2.5 x forward (fwd+bwd 3.5 x)."""
    full = shapes.AttnShape("g", 3, 4, 64, 128, 0, False, False, shapes.MODES, "cpu")
    assert full.flops(shapes.FWD) == 6 * 128 * 128 * 64 * 3 * 4
    assert full.flops(shapes.FWD, "plain") == 4 * 128 * 128 * 64 * 3 * 4
    assert full.flops(shapes.FWD_BWD) == pytest.approx(3.5 * full.flops(shapes.FWD))
    case = shapes.Case("attention", full, "bf16", shapes.FWD_BWD)
    assert case.flops("sdpa_plain") == pytest.approx(3.5 * 4 * 128 * 128 * 64 * 3 * 4)
    assert case.flops("fused") == case.flops("sdpa_bias") == full.flops(shapes.FWD_BWD)
    causal = shapes.AttnShape("g", 1, 1, 32, 100, 0, True, False, shapes.MODES, "cpu")
    assert causal.flops(shapes.FWD) == 6 * 32 * 100 * 101 // 2
    padded = shapes.AttnShape("g", 8, 8, 64, 1024, 0, False, True, shapes.MODES, "cpu")
    lengths = padded.lengths()
    assert lengths[0] == 1024 and min(lengths) >= int(0.7 * 1024) and lengths == sorted(lengths)[::-1]
    assert padded.flops(shapes.FWD) == 6 * 64 * 8 * 1024 * sum(lengths)
    m = shapes.ModuleShape("m", 2, 8, 64, 256, shapes.MODES, "cpu", key_padding=False)
    nf = 512
    assert m.flops(shapes.FWD) == 6 * 256 * 256 * 64 * 2 * 8 + 8 * 2 * 256 * nf * nf + 2 * 511 * nf * nf


def test_matrix_has_the_txl_conformer_and_long_sequence_shapes():
    gpu = shapes.attention_shapes("cuda")
    by = {(s.group, s.B, s.H, s.D, s.Lq, s.mem): s for s in gpu}
    assert by[("txl_train", 16, 8, 64, 512, 512)].causal
    for H in (8, 16):
        for q, m in ((64, 640), (128, 1600), (128, 3800)):
            assert by[("txl_eval", 16, H, 64, q, m)].modes == (shapes.FWD,)
    for T in (1024, 4096):
        s = by[("conformer", 8, 8, 64, T, 0)]
        assert not s.causal and s.key_padding and s.R == 2 * T - 1 and s.modes == shapes.MODES
    for T in (16384, 65536):
        assert by[("long", 1, 8, 64, T, 0)].modes == shapes.MODES
    assert [s.layers for s in shapes.mems_shapes("cuda")] == [4, 16, 32]
    assert [s.layers for s in shapes.mems_shapes("cpu")] == [4, 16, 32]
    assert {s.T for s in shapes.module_shapes("cuda")} == {1024, 4096}
    cases = shapes.all_cases("cuda")
    assert {c.dtype for c in cases} == {"bf16", "fp16"}
    assert cases[0].dtype == "bf16" and len({c.key for c in cases}) == len(cases)
    assert tuple(P.ATTN_PROVIDERS) == shapes.PROVIDER_ORDER["attention"]


# ---------------------------------------------------------------------------------------------
# Providers against the reference


def test_nemo_rel_shift_equals_reference_shift_on_allowed_pairs():
    g = torch.Generator().manual_seed(0)
    for Lq, Lk, R in ((5, 9, 9), (7, 7, 13), (1, 6, 6), (4, 11, 14)):
        bdt = torch.randn(2, 3, Lq, R, generator=g)
        ours = P.nemo_rel_shift(bdt)[..., :Lk]
        ref = rel_shift(bdt, Lk)
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        p = j - i + Lq - 1
        valid = (p >= 0) & (p < R)
        assert torch.equal(ours[..., valid], ref[..., valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"B{c[0]}q{c[1]}m{c[2]}H{c[3]}D{c[4]}")
def test_sdpa_bias_matches_reference(cfg, dtype):
    _check_against_reference(P.sdpa_bias, cfg, dtype, factor=BASELINE_FACTOR)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"B{c[0]}q{c[1]}m{c[2]}H{c[3]}D{c[4]}")
def test_sdpa_plain_is_reference_without_position_terms(cfg, dtype):
    _check_against_reference(P.sdpa_plain, cfg, dtype, zero_pos=True)


def test_sdpa_plain_differs_when_position_terms_are_present():
    # The floor is not the same function: the test above cannot pass by accident.
    inp = _attn_inputs(CONFIGS[0], torch.float32, requires_grad=False)
    assert (P.sdpa_plain(inp) - P.reference(inp)).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"B{c[0]}q{c[1]}m{c[2]}H{c[3]}D{c[4]}")
def test_flex_forward_matches_reference_cpu(cfg, dtype):
    # Eager FlexAttention on CPU (forward only: no CPU backward); the block mask is reused.
    fn = lambda inp: P.flex(inp, compiled=False)  # noqa: E731
    _check_against_reference(fn, cfg, dtype, grads=False, factor=BASELINE_FACTOR)


def test_flex_block_mask_is_built_once_per_input_set():
    inp = _attn_inputs(CONFIGS[0], torch.float32, requires_grad=False)
    bm = P.flex_block_mask(inp)
    assert bm is not None and P.flex_block_mask(inp) is bm
    full = _attn_inputs((1, 5, 0, 1, 8, False, None), torch.float32, requires_grad=False)
    assert P.flex_block_mask(full) is None


@requires_cuda
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["txl", "conformer"])
def test_flex_eager_gradients_match_reference_cuda(cfg):
    # Gradients through the captured BD table (FlexAttention has no CPU backward); eager mode
    # keeps this cheap, the compiled path is checked once below.
    fn = lambda inp: P.flex(inp, compiled=False)  # noqa: E731
    _check_against_reference(fn, cfg, torch.float32, device="cuda")


@requires_cuda
def test_flex_compiled_matches_reference_cuda():
    # What is timed: the compiled provider, forward and every gradient (one compile), on a
    # padded full-attention shape with a power-of-two head dim like the benchmark's.
    _check_against_reference(P.flex, (2, 37, 0, 2, 32, False, (37, 20)), torch.bfloat16,
                             device="cuda")


@requires_cuda
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["txl", "conformer"])
def test_sdpa_bias_matches_reference_cuda(cfg):
    _check_against_reference(P.sdpa_bias, cfg, torch.float16, device="cuda",
                             factor=BASELINE_FACTOR)


@requires_cuda
@pytest.mark.parametrize("fn", [P.fused, P.fused_deterministic], ids=["atomic", "ordered"])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["txl", "conformer"])
def test_fused_provider_matches_reference_cuda(cfg, fn):
    _check_against_reference(fn, cfg, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("key_padding", [True, False])
def test_module_sdpa_baseline_matches_module_reference(key_padding):
    mshape = shapes.ModuleShape("m", 3, 2, 16, 19, shapes.MODES, "cpu", key_padding=key_padding)
    inp = P.make_module_inputs(mshape, "fp32", "cpu", "reference", requires_grad=True)
    assert float(inp.module.pos_bias_u.detach().abs().sum()) > 0  # the biases take part
    ref = P.nemo_reference(inp)
    base = P.nemo_sdpa_bias(inp)
    assert ref.shape == (3, 19, 32)
    torch.testing.assert_close(base, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    params = inp.grad_inputs()
    ga = torch.autograd.grad(ref, params, g)
    gb = torch.autograd.grad(base, params, g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_module_providers_pin_their_backend():
    mshape = shapes.module_shapes("cpu")[0]
    for name, backend in P.MODULE_BACKEND.items():
        inp = P.make_module_inputs(mshape, "fp32", "cpu", backend, family=P.MODULE_FAMILY[name])
        assert inp.module.backend == backend, name
        want = "ESPnet" if name.startswith("espnet") else "NeMo"
        assert type(inp.module).__name__.startswith(want), name


@pytest.mark.parametrize("key_padding", [True, False])
def test_espnet_module_provider_matches_nemo_on_unpadded_rows(key_padding):
    """Same weights and inputs: the ESPnet drop-in computes the same attention as the NeMo one
    on every query row that is not padded (NeMo also zeroes padded query rows)."""
    mshape = shapes.ModuleShape("m", 3, 2, 16, 19, shapes.MODES, "cpu", key_padding=key_padding)
    nemo = P.make_module_inputs(mshape, "fp32", "cpu", "reference")
    esp = P.make_module_inputs(mshape, "fp32", "cpu", "reference", family="espnet")
    esp.module.load_state_dict(nemo.module.state_dict())
    a, b = P.nemo_reference(nemo), P.espnet_reference(esp)
    keep = torch.ones(a.shape[:2], dtype=torch.bool) if nemo.key_padding_mask is None \
        else ~nemo.key_padding_mask
    torch.testing.assert_close(b[keep], a[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ext_len", [0, 3])
def test_mems_baseline_is_the_formula_and_the_library_agrees(ext_len):
    s = shapes.MemsShape("update_mems", 3, 9, 6, 2, 5, "cpu", ext_len=ext_len)
    inp = P.make_mems_inputs(s, "fp32", "cpu")
    got = P.torch_cat_mems(inp)
    end = 6 + max(0, 9 - ext_len)
    beg = max(0, end - 6)
    for m, h, g in zip(inp.mems, inp.hids, got):
        assert torch.equal(g, torch.cat([m, h])[beg:end])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback warning is fine here
        lib = P.library_update_mems(inp)
    assert len(lib) == len(got)
    for a, b in zip(lib, got):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# The runner


def _cpu_case(provider_mode=shapes.FWD):
    s = shapes.AttnShape("tiny", 1, 2, 16, 9, 4, True, False, shapes.MODES, "cpu")
    return shapes.Case("attention", s, "bf16", provider_mode)


def test_runner_times_and_records():
    case = _cpu_case(shapes.FWD_BWD)
    calls = []

    def timer(step, device):
        calls.append(device)
        return runner.measure(step, device, 0.0)

    rec = runner.run_case(case, "sdpa_bias", timer)
    assert rec["status"] == "ok", rec
    assert rec["reps"] >= 1 and rec["time_s"] > 0 and calls == [torch.device("cpu")]
    assert rec["tflops"] == pytest.approx(case.flops("sdpa_bias") / rec["time_s"] / 1e12)
    assert rec["peak_bytes"] is None  # CPU: no peak memory


def test_deterministic_provider_runs_forward_backward_only():
    """fused_deterministic differs from fused only in the backward: not timed forward-only,
    and not a baseline (the tables compare both of ours against the others)."""
    shape = shapes.attention_shapes("cuda")[0]
    fwd = shapes.Case("attention", shape, "bf16", shapes.FWD)
    assert runner.skip_reason(fwd, "fused_deterministic") == "timed in fwd+bwd only"
    both = shapes.Case("attention", shape, "bf16", shapes.FWD_BWD)
    assert runner.skip_reason(both, "fused_deterministic") == runner.skip_reason(both, "fused")
    assert "fused_deterministic" not in shapes.BASELINES["attention"]
    assert shapes.BASELINES["attention"] == ("reference", "sdpa_bias", "flex", "sdpa_plain")


def test_runner_skips_gpu_only_providers_on_cpu():
    for case, name in ((_cpu_case(), "fused"), (_cpu_case(), "flex"),
                       (_cpu_case(shapes.FWD_BWD), "fused_deterministic")):
        rec = runner.run_case(case, name, lambda s, t: pytest.fail("must not be timed"))
        assert rec["status"] == "skipped" and "CUDA" in rec["reason"]
    gpu_case = shapes.Case("attention", shapes.attention_shapes("cuda")[0], "bf16", shapes.FWD)
    if not HAS_CUDA:
        rec = runner.run_case(gpu_case, "reference", lambda s, t: pytest.fail("no"))
        assert rec["status"] == "skipped" and "CUDA" in rec["reason"]


def test_runner_records_oom_and_the_matrix_goes_on(monkeypatch):
    def boom(inp):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setitem(P.ATTN_PROVIDERS, "reference",
                        P.Provider("reference", boom, False))
    case = _cpu_case()
    recs = report.run_matrix([case], "cpu", {"reference", "sdpa_plain"},
                             runner.timer_for(0.0), deadline=float("inf"),
                             t_start=0.0, log=lambda *_: None)
    st = {r["provider"]: r["status"] for r in recs}
    assert st == {"reference": "oom", "sdpa_plain": "ok"}
    results.add_ratios(recs)
    ok = [r for r in recs if r["status"] == "ok"][0]
    assert ok["speedup_vs"] == {"reference": "OOM"}


def test_runner_raises_real_errors_or_records_them(monkeypatch):
    def bad(inp):
        raise ValueError("shape mismatch")

    monkeypatch.setitem(P.ATTN_PROVIDERS, "sdpa_plain", P.Provider("sdpa_plain", bad, False))
    case = _cpu_case()
    rec = runner.run_case(case, "sdpa_plain", runner.timer_for(0.0))
    assert rec["status"] == "error" and "shape mismatch" in rec["reason"]
    with pytest.raises(ValueError, match="shape mismatch"):
        runner.run_case(case, "sdpa_plain", runner.timer_for(0.0), raise_errors=True)


def test_time_budget_marks_the_rest_not_run():
    recs = report.run_matrix([_cpu_case()], "cpu", {"reference"}, runner.timer_for(0.0),
                             deadline=0.0, t_start=0.0, log=lambda *_: None)
    assert recs[0]["status"] == "skipped" and "time budget" in recs[0]["reason"]


def test_measure_uses_torch_benchmark_timer_on_cpu():
    """CPU timing is torch.utils.benchmark's: the per-call mean of each block it ran."""
    calls = []
    times = runner.measure(lambda: calls.append(1), torch.device("cpu"), 0.01)
    assert times and all(t > 0 for t in times)
    assert len(calls) > len(times)  # blocks of several calls, plus its calibration


# ---------------------------------------------------------------------------------------------
# Ratios, tables, the results section, the plot (synthetic records)


def _rec(provider, status="ok", t=None, peak=None, key="attention|cuda|conformer|L|bf16|fwd",
         seqlen=1024, kind="attention", series="conformer B8 bf16 fwd"):
    return dict(kind=kind, key=key, group="conformer", device="cuda", label="L", dtype="bf16",
                mode="fwd", provider=provider, seqlen=seqlen, series=series, status=status,
                reason="out of memory: CUDA out of memory" if status == "oom" else
                ("needs CUDA" if status == "skipped" else ""),
                time_s=t, reps=5 if t else 0, flops=1e12, tflops=(1.0 / t) if t else None,
                bandwidth_gbs=None, peak_bytes=peak, work_bytes=None, note="")


def _synthetic():
    return [_rec("fused", t=0.010, peak=1 * 2 ** 30), _rec("reference", t=0.040, peak=8 * 2 ** 30),
            _rec("sdpa_bias", "oom"), _rec("flex", t=0.020, peak=4 * 2 ** 30),
            _rec("sdpa_plain", "skipped")]


def test_add_ratios():
    recs = results.add_ratios(_synthetic())
    fused = recs[0]
    assert fused["speedup_vs"] == pytest.approx({"reference": 4.0, "sdpa_bias": "OOM", "flex": 2.0}) \
        or (fused["speedup_vs"]["reference"] == pytest.approx(4.0)
            and fused["speedup_vs"]["flex"] == pytest.approx(2.0)
            and fused["speedup_vs"]["sdpa_bias"] == "OOM")
    assert set(fused["speedup_vs"]) == {"reference", "sdpa_bias", "flex"}
    assert fused["mem_ratio_vs"]["reference"] == pytest.approx(8.0)
    assert recs[1]["speedup_vs"]["fused"] == pytest.approx(0.25)
    assert recs[2]["speedup_vs"] == {} and recs[4]["speedup_vs"] == {}
    # ratios never cross cases
    other = _rec("reference", t=1.0, peak=1, key="attention|cuda|conformer|L2|bf16|fwd")
    results.add_ratios(recs + [other])
    assert other["speedup_vs"] == {}


def test_format_markdown():
    text = results.format_markdown(_synthetic())
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("| case"))
    assert header.split("|")[5:-1] == [" time (ms) ", " TFLOP/s ", " peak mem ", " vs reference ",
                                       " vs sdpa_bias ", " vs flex ", " vs sdpa_plain "]
    fused = next(ln for ln in lines if "| fused |" in ln)
    cells = [c.strip() for c in fused.split("|")[1:-1]]
    assert cells[4:] == ["10.0", "100.0", "1.00 GiB", "4.00x / 8.00x", "X OOM", "2.00x / 4.00x", ""]
    sdpa = next(ln for ln in lines if "| sdpa_bias |" in ln)
    assert [c.strip() for c in sdpa.split("|")[1:-1]][4] == "OOM"
    assert "2.5 x forward" in text and "needs CUDA" in text
    # rows follow the provider order (the synthetic case has every provider but the
    # deterministic one)
    order = [ln.split("|")[4].strip() for ln in lines if ln.startswith("| conformer")]
    assert order == [p for p in shapes.PROVIDER_ORDER["attention"]
                     if p != "fused_deterministic"]


def test_update_mems_table_uses_bandwidth():
    r = _rec("update_mems", t=0.001, kind="update_mems", key="update_mems|cuda|x|bf16|fwd")
    r["bandwidth_gbs"] = 1234.5
    text = results.format_markdown([r, _rec("torch_cat", t=0.002, kind="update_mems",
                                            key="update_mems|cuda|x|bf16|fwd")])
    assert "| GB/s |" in text and "1234.5" in text and "2.00x" in text


def test_update_section_replaces_between_markers_only():
    md = f"# B\n\nintro\n\n{results.BEGIN}\nNo GPU numbers yet.\n{results.END}\n\ntail\n"
    once = results.update_section(md, "new body")
    assert "No GPU numbers yet" not in once and "new body" in once
    assert once.startswith("# B\n\nintro") and once.rstrip().endswith("tail")
    twice = results.update_section(once, "newer")
    assert "new body" not in twice and twice.count(results.BEGIN) == 1
    appended = results.update_section("# other\n", "body")
    assert appended.count(results.BEGIN) == 1 and appended.strip().endswith(results.END)


def test_results_section_and_plot(tmp_path):
    recs = _synthetic() + [
        _rec("fused", t=0.05, peak=3 * 2 ** 30, key="k2", seqlen=4096),
        _rec("reference", "oom", key="k2", seqlen=4096),
    ]
    png = results.plot(recs, str(tmp_path / "p.png"), title="synthetic")
    assert png and (tmp_path / "p.png").stat().st_size > 1000
    env = dict(date="2030-01-01", gpu="Synthetic GPU", torch="t", triton="x", cuda="c",
               python="3")
    sec = results.results_section(recs, env, "python benchmarks/report.py", "passed", "p.png")
    assert "Synthetic GPU" in sec and "`python benchmarks/report.py`" in sec
    assert "![time and peak memory" in sec
    assert any(ln.startswith("- conformer L bf16 fwd: reference 4.00x") for ln in sec.splitlines())


@pytest.mark.slow  # the whole report in CPU smoke mode (~20 s on two cores)
def test_report_cpu_smoke_end_to_end(tmp_path):
    md = tmp_path / "BENCH.md"
    md.write_text(f"# Bench\n\n{results.BEGIN}\nNo GPU numbers yet.\n{results.END}\n")
    rc = report.main(["--cpu-smoke", "--skip-tests", "--groups", "txl_eval", "--dtypes", "bf16",
                      "--out-dir", str(tmp_path), "--md", str(md)])
    assert rc == 0
    data = json.loads((tmp_path / "results-cpu-smoke.json").read_text())
    st = {r["provider"]: r["status"] for r in data["records"]}
    assert st == {"fused": "skipped", "fused_deterministic": "skipped", "reference": "ok",
                  "sdpa_bias": "ok", "flex": "skipped", "sdpa_plain": "ok"}
    text = md.read_text()
    assert "No GPU numbers yet" not in text and "CPU SMOKE RUN" in text
    assert (tmp_path / "results-cpu-smoke.png").exists()
