"""benchmarks/onnx_encoder.py: the exported original and swapped Parakeet encoders in ONNX
Runtime, end to end on a tiny encoder (``--quick``), and its table's verdict on synthetic
records. No timing is asserted."""
import json

import pytest

from helpers import require_onnx_parakeet

from benchmarks import onnx_encoder


@pytest.mark.slow  # an export and fresh ONNX Runtime processes (~15 s on two cores)
def test_quick_run_exports_checks_and_reports(tmp_path, capsys):
    require_onnx_parakeet()
    out = tmp_path / "records.json"
    assert onnx_encoder.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    exp = recs["export"]
    for key in ("original_ort_vs_eager", "swapped_ort_vs_eager", "eager_swapped_vs_original"):
        assert exp[key] < onnx_encoder.AGREE_TOL, (key, exp[key])
    # the graphs have no fixed length: checked and timed at lengths other than the export's
    assert exp["check_mel_frames"] != exp["export_mel_frames"]
    points = recs["points"]
    assert len(points) == 2 * len(onnx_encoder.QUICK["minutes"])
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["peak_bytes"] > 0
               for r in points)
    assert sorted({r["T"] for r in points}) == [
        onnx_encoder.long_audio.encoder_frames(m) for m in onnx_encoder.QUICK["minutes"]]
    assert all(d < onnx_encoder.AGREE_TOL for d in recs["agree"].values())
    for needle in ("onnxruntime 1.", "onnx 1.", "transformers 5.", "command: python "
                   "benchmarks/onnx_encoder.py --quick", "| 3 s | 38 | 1 |", "| 6 s | 75 | 1 |",
                   "target (swapped within 10% of original at every point)"):
        assert needle in text, needle


def test_table_marks_points_over_the_target():
    args = onnx_encoder.parse_args(["--quick"])
    ok = dict(status="ok", T=38, peak_bytes=2 ** 30, cpu_seconds=1.0)
    points = {(0.05, 1, "original"): [dict(ok, seconds=1.0), dict(ok, seconds=3.0)],
              (0.05, 1, "swapped"): [dict(ok, seconds=1.2), dict(ok, seconds=1.0)],
              (0.1, 1, "original"): [dict(ok, seconds=1.0)],
              (0.1, 1, "swapped"): [dict(ok, seconds=1.2)],
              (0.2, 1, "original"): [dict(ok, seconds=1.0)],
              (0.2, 1, "swapped"): [dict(status="failed", reason="exit 1: boom")]}
    text, over = onnx_encoder.table(points, {0.05: 1e-6}, args)
    # medians: 2.0 vs 1.1 (yes), 1.0 vs 1.2 (over), and a failed point counts as not met
    assert "| 3 s | 38 | 1 | 2.000 | 1.100 | 0.550 | 1.000 | 1.00 | 1.00 | 1.0e-06 | yes |" in text
    assert "| 1.200 |" in text and "| NO |" in text and "exit 1: boom" in text
    assert over == [(0.1, 1, pytest.approx(1.2)), (0.2, 1, None)]
