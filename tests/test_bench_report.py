"""benchmarks/report.py --cpu-smoke and its plot: results in ./bench-results/, the plotted
dtype's CPU shapes at three lengths, and a figure that draws only what was measured (time curves; no memory
row where no peak memory was measured) with its title clear of the first row."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from benchmarks import report, results


def _rec(provider, seqlen, series, t=0.01, peak=None, status="ok"):
    return dict(kind="attention", key=f"{series}|{seqlen}", group="g", device="cpu",
                label=f"L{seqlen}", dtype="bf16", mode="fwd", provider=provider, seqlen=seqlen,
                series=series, status=status, reason="", time_s=t if status == "ok" else None,
                reps=3, flops=1e9, tflops=None, bandwidth_gbs=None, peak_bytes=peak,
                work_bytes=None, note="")


def _figure_of(monkeypatch, tmp_path, records, title="txl_kernels benchmarks, CPU smoke run"):
    """Draw ``records`` with results.plot and return the figure it saved."""
    saved = []
    real = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        saved.append(fig)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert results.plot(records, str(tmp_path / "p.png"), title=title)
    return saved[0]


def _title_clear_of_panels(fig) -> None:
    """The figure's title sits above every panel's own title and tick labels."""
    canvas = FigureCanvasAgg(fig)  # the figure was closed: draw it on a canvas of its own
    canvas.draw()
    renderer = canvas.get_renderer()
    title_box = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        if ax.axison:
            assert ax.get_tightbbox(renderer).y1 <= title_box.y0 + 0.5, (ax.get_title(),
                                                                          title_box)


def _visible_axes(fig):
    return [ax for ax in fig.axes if ax.axison]


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_cpu_plot_draws_time_curves_only(monkeypatch, tmp_path):
    series = [f"s{i} B2 H2 D32 causal bf16 fwd" for i in range(5)]
    recs = [_rec(p, L, s, t=L * 1e-5) for s in series for p in ("reference", "sdpa_plain")
            for L in (40, 80, 160)]
    fig = _figure_of(monkeypatch, tmp_path, recs)
    axes = _visible_axes(fig)
    assert len(axes) == len(series), "one time panel per series, no memory panels"
    for ax in axes:
        assert ax.get_ylabel() == "median time (ms)"
        assert [len(line.get_xdata()) for line in ax.lines] == [3, 3]
    assert not any("memory" in t or "CUDA" in t for t in _texts(fig)), _texts(fig)
    _title_clear_of_panels(fig)


def test_gpu_plot_keeps_the_memory_row(monkeypatch, tmp_path):
    recs = [_rec(p, L, "s B8 fwd", t=L * 1e-6, peak=L * 2 ** 20) for p in ("fused", "reference")
            for L in (1024, 4096)]
    fig = _figure_of(monkeypatch, tmp_path, recs, title="GPU")
    labels = sorted(ax.get_ylabel() for ax in _visible_axes(fig))
    assert labels == ["median time (ms)", "peak memory (GiB)"]
    _title_clear_of_panels(fig)


def test_cpu_smoke_writes_to_bench_results_and_sweeps_lengths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report, "lm_quant_section", lambda *a, **k: "")  # not under test here
    rc = report.main(["--cpu-smoke", "--skip-tests", "--groups", "txl_eval", "--dtypes", "bf16",
                      "--providers", "reference", "--no-md"])
    assert rc == 0
    out = tmp_path / "bench-results"
    assert {p.name for p in out.iterdir()} == {"results-cpu-smoke.json", "results-cpu-smoke.png",
                                              "results-cpu-smoke.md"}
    recs = json.loads((out / "results-cpu-smoke.json").read_text())["records"]
    ref = [r for r in recs if r["provider"] == "reference" and r["status"] == "ok"]
    assert len({r["series"] for r in ref}) == 1
    assert sorted(r["seqlen"] for r in ref) == [88, 176, 352]  # (16 + 160) x 0.5, 1, 2


@pytest.mark.parametrize("kind", ["attention", "conformer_module", "update_mems"])
def test_length_sweep_gives_each_plotted_series_three_lengths(kind):
    from benchmarks import runner, shapes

    cases = [c for c in shapes.all_cases("cpu", ("bf16", "fp16")) if c.kind == kind]
    swept = report.length_sweep(cases)
    plotted = [c for c in cases if c.dtype == "bf16"]
    if kind == "update_mems":
        assert swept == cases
        return
    assert len(swept) == len(cases) + 2 * len(plotted)
    assert [c for c in swept if c.dtype == "fp16"] == [c for c in cases if c.dtype == "fp16"]
    for case in plotted:
        same = [c for c in swept if runner.series_of(c) == runner.series_of(case)]
        assert len({c.shape.seqlen for c in same}) == 3, [c.shape.label for c in same]
