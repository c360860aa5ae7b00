"""The summit's verdict (common.report.summit_rows / summit_verdict) on a bench_summit.py record:
the last stage against stage 11 per round on the bounded gate, against the earlier kernel on the
softplus gate."""

from common import report


def _row(part, stage, ms, rnd, **kw):
    return dict(part=part, stage=stage, B=1, T=1024, H=64, K=128, V=128, round=rnd, graph_ms=ms, **kw)


def _record(last_ms, before_ms=(1.0, 1.0, 1.0), equal=True):
    rows = []
    for rnd, (t12, tb) in enumerate(zip(last_ms, before_ms)):
        rows += [_row("bounded", "11_varlen", 1.0, rnd), _row("bounded", "12_softplus", t12, rnd, equal_to_11=equal),
                 _row("bounded", "FlashKDA", 2.0, rnd), _row("softplus", "12_softplus", 1.0, rnd),
                 _row("softplus", "12_softplus", tb, rnd, kernel="before")]
    return dict(meta={}, rows=rows)


def test_the_bound_is_judged_on_the_median_round_and_the_worst_is_kept():
    (row,) = report.summit_rows(_record((1.0, 1.03, 1.04)))
    assert row["last / 11"] == 1.03 and row["last / 11 worst"] == 1.04 and row["rounds"] == 3
    assert row["last ms"] == 1.03 and row["last / FlashKDA"] == 1.03 / 2.0
    v = report.summit_verdict([row])
    assert not v["bounded_ok"] and v["bounded_over"] == [row["shape"]] and v["bounded_worst"] == 1.03
    # one slow round among three does not decide; two do
    assert report.summit_verdict(report.summit_rows(_record((1.0, 1.11, 1.02))))["bounded_ok"]
    assert not report.summit_verdict(report.summit_rows(_record((1.03, 1.11, 1.0))))["bounded_ok"]


def test_the_ratio_is_taken_within_a_round():
    # stage 11 drifts between rounds as much as the last stage: the ratio is 1 in each round
    rows = []
    for rnd, t in enumerate((1.0, 1.5, 2.0)):
        rows += [_row("bounded", "11_varlen", t, rnd), _row("bounded", "12_softplus", t, rnd, equal_to_11=True)]
    (row,) = report.summit_rows(dict(meta={}, rows=rows))
    assert row["last / 11"] == 1.0 and row["last / 11 worst"] == 1.0 and row["11 ms"] == 1.5


def test_softplus_now_against_before_and_bitwise():
    rows = report.summit_rows(_record((1.0, 1.0), before_ms=(0.98, 0.98), equal=False))
    v = report.summit_verdict(rows)
    assert v["softplus_slower"] == [rows[0]["shape"]] and abs(v["softplus_worst"] - 1 / 0.98) < 1e-12
    assert not v["bitwise"]
    assert report.summit_verdict(report.summit_rows(_record((1.0, 1.0))))["bitwise"]


def test_notebook_12_shows_its_declared_summit_record(capsys):
    from common import notebook as nb
    from common.stages import declared_records

    styled = nb.summit_table("12")
    out = capsys.readouterr().out
    name = declared_records("summit")["12"]
    assert f"{name.split('/')[-1]}.json" in out and "bound 1.02x" in out
    rows = report.summit_rows(nb.results.recorded(name))
    assert list(styled.data.index) == [r["shape"] for r in rows]
    assert list(styled.data["last / 11"]) == [r["last / 11"] for r in rows]


def test_control_rows_stay_apart_from_the_in_process_rows():
    # today's kernel timed from a subprocess (kernel "control") must not be taken for the in-process row
    rec = _record((1.0, 1.0), before_ms=(0.98, 0.98))
    rec["rows"] += [_row("softplus", "12_softplus", 0.97, rnd, kernel="control") for rnd in range(2)]
    (row,) = report.summit_rows(rec)
    assert row["softplus ms"] == 1.0 and abs(row["now / before"] - 1 / 0.98) < 1e-12
    assert abs(row["control / before"] - 0.97 / 0.98) < 1e-12
    # the verdict takes the like-for-like ratio where the record has it
    v = report.summit_verdict([row])
    assert v["softplus_by"] == "control / before" and v["softplus_slower"] == []
    assert abs(v["softplus_worst"] - 0.97 / 0.98) < 1e-12


def test_gate_profile_is_its_record():
    # notebook 12's profile of both gates: each column the record's cycles per chunk (K1 a block per chunk, K2 a
    # block over the 256 chunks of T = 4096), the ratio softplus over bounded
    from common import notebook as nb
    from common.stages import declared_records

    data = nb.results.recorded(declared_records("gate_profile")["12"])
    styled = nb.gate_profile("12", shape="B1 T4096 H16 K128 V128")
    t = styled.data
    rows = {(r["stage"][:2], r["gate"], r["region"]): r["value"] for r in data["rows"]
            if (r["B"], r["T"], r["H"]) == (1, 4096, 16)}
    for region in t.index:
        per = 1 if region.startswith("K1") else 256
        assert t.loc[region, "12 softplus"] == rows[("12", "softplus", region)] / per
        assert t.loc[region, "11 bounded"] == rows[("11", "bounded", region)] / per
        assert abs(t.loc[region, "softplus / bounded"]
                   - rows[("12", "softplus", region)] / rows[("12", "bounded", region)]) < 1e-12
