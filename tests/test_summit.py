"""The summit's verdict (common.report.summit_rows / summit_verdict) on a bench_summit.py record:
the last stage against stage 11 per round on the bounded gate, against the earlier kernel on the
softplus gate."""

from common import report


def _row(part, stage, ms, rnd, **kw):
    return dict(part=part, stage=stage, B=1, T=1024, H=64, K=128, V=128, round=rnd, graph_ms=ms, **kw)


def _record(last_ms, before_ms=(1.0, 1.0), equal=True):
    rows = []
    for rnd, (t12, tb) in enumerate(zip(last_ms, before_ms)):
        rows += [_row("bounded", "11_varlen", 1.0, rnd), _row("bounded", "12_softplus", t12, rnd, equal_to_11=equal),
                 _row("bounded", "FlashKDA", 2.0, rnd), _row("softplus", "12_softplus", 1.0, rnd),
                 _row("softplus", "12_softplus", tb, rnd, kernel="before")]
    return dict(meta={}, rows=rows)


def test_the_bound_is_judged_on_the_worse_round():
    (row,) = report.summit_rows(_record((1.0, 1.03)))
    assert row["last / 11"] == 1.03 and row["last ms"] == 1.03 and row["last / FlashKDA"] == 1.03 / 2.0
    v = report.summit_verdict([row])
    assert not v["bounded_ok"] and v["bounded_over"] == [row["shape"]]
    assert report.summit_verdict(report.summit_rows(_record((1.0, 1.02))))["bounded_ok"]


def test_softplus_now_against_before_and_bitwise():
    rows = report.summit_rows(_record((1.0, 1.0), before_ms=(1.0, 0.98), equal=False))
    v = report.summit_verdict(rows)
    assert v["softplus_slower"] == [rows[0]["shape"]] and abs(v["softplus_worst"] - 1 / 0.98) < 1e-12
    assert not v["bitwise"]
    assert report.summit_verdict(report.summit_rows(_record((1.0, 1.0))))["bitwise"]
