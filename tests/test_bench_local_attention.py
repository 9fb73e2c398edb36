"""benchmarks/local_attention.py: NeMo's local attention (the transcription) against the
drop-in, end to end at tiny sizes (fresh processes, both directions, G 0 and 1, agreement
checked, the tables and the targets block), and the report's arithmetic. No timing is
asserted."""

import pytest

from benchmarks import local_attention as LA

MiB = 2 ** 20


@pytest.mark.slow  # 8 fresh processes of the script (~35 s on two cores)
def test_quick_run_end_to_end(tmp_path, capsys):
    path = tmp_path / "recs.json"
    rc = LA.main(["--quick", "--backend", "reference", "--pad-frac", "0.1", "--json",
                  str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    import json

    recs = json.loads(path.read_text())
    assert len(recs) == 8 and {r["status"] for r in recs} == {"ok"}
    assert {(r["variant"], r["G"], r["direction"]) for r in recs} == {
        (v, G, d) for v in LA.VARIANTS for G in (0, 1) for d in LA.DIRECTIONS}
    for r in recs:
        assert r["T"] == 300 and r["threads"] == 1 and r["layers"] == 1
        assert r["attention_s"] == pytest.approx(r["module_s"] - r["projections_s"])
        assert r["attention_extra_bytes"] == (r["module_extra_bytes"]
                                              - r["projections_extra_bytes"])
        assert ("grad_fingerprint" in r) == (r["direction"] == "fwdbwd")
    for (_, G, _, d), (n, t) in LA.point_pairs(recs).items():
        assert LA.agreement(n, t) <= LA.AGREE_TOL, (G, d)
    assert out.count("| 0.4 min | 300 |") == 4  # two G per direction table
    assert "fwd: a stack of 1 local-attention module(s)" in out and "pad_frac 0.1" in out
    assert "fwdbwd: a stack of 1 local-attention module(s)" in out
    assert "targets at the longest length (0.4 min, T 300)" in out
    assert out.count("\n  fwd    G=") == 2 and out.count("\n  fwdbwd G=") == 2
    assert "OUTPUTS DISAGREE" not in out


def _rec(variant, mod_s, proj_s, mod_x, proj_x, fp, minutes=60, G=1, d="fwd"):
    return dict(variant=variant, minutes=minutes, T=LA.frames(minutes), G=G, threads=2,
                direction=d, status="ok", module_s=mod_s, projections_s=proj_s,
                attention_s=mod_s - proj_s, module_extra_bytes=mod_x * MiB,
                projections_extra_bytes=proj_x * MiB,
                attention_extra_bytes=(mod_x - proj_x) * MiB, out_max=10.0, fingerprint=fp)


def test_targets_block_and_disagreement(capsys):
    recs = [_rec("nemo", 10.0, 2.0, 1000, 100, [1.0, 2.0]),
            _rec("txl", 4.0, 2.0, 300, 100, [1.0, 2.0]),
            _rec("nemo", 1.0, 0.5, 100, 10, [1.0], minutes=10),
            _rec("txl", 1.0, 0.5, 100, 10, [1.0], minutes=10)]
    lines = LA.targets(recs, LA.parse_args(["--quick"]))
    assert lines[0].startswith("targets at the longest length (60 min, T 45000)")
    assert len(lines) == 2
    assert ("module speed-up 2.50 >= 2: PASS; attention speed-up 4.00 >= 3: PASS; attention "
            "extra memory ratio 0.222 <= 0.25: PASS (module extra memory ratio 0.300, info)"
            in lines[1])
    recs[1] = _rec("txl", 6.0, 2.0, 400, 100, [1.0, 2.002])
    (_, line) = LA.targets(recs, LA.parse_args(["--quick"]))
    assert ("module speed-up 1.67 >= 2: MISS; attention speed-up 2.00 >= 3: MISS; attention "
            "extra memory ratio 0.333 <= 0.25: MISS" in line)
    assert LA.agreement(recs[0], recs[1]) == pytest.approx(2e-4)
    assert "2.0e-04 FAILED" in LA.table(recs, "fwd", LA.parse_args(["--quick"]))


def test_nemo_memory_guard():
    # [1, 8, 45056, 257] fp32 = 0.35 GiB per score tensor
    one = 8 * 45056 * 257 * 4
    assert LA.nemo_score_bytes(45000, 8, [128, 128], 0, "fwd", 3) == one * 14
    assert LA.nemo_score_bytes(45000, 8, [128, 128], 0, "fwdbwd", 3) == one * 20 * 3


def test_bad_arguments_name_the_option():
    with pytest.raises(SystemExit):
        LA.parse_args(["--window", "0", "0"])
    with pytest.raises(SystemExit):
        LA.parse_args(["--pad-frac", "1.5"])
    args = LA.parse_args([])
    assert (args.minutes, args.threads, args.window, args.hidden, args.heads,
            args.repeats, args.global_tokens, args.directions) == (
        [10, 30, 60], [1, 2], [128, 128], 1024, 8, 3, [0, 1], ["fwd", "fwdbwd"])
