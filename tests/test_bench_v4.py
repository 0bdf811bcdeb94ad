"""CPU: how ``benchmarks.bench_v4`` makes a row of its draws (medians, the ratio's range, the first
failing check, the first draw's memory) and seeds each draw by the row alone."""

from types import SimpleNamespace

import pytest

from benchmarks import bench_v4


def _draws(cute_us, flash_us, checks=None):
    checks = checks or ["ok"] * len(cute_us)

    def run_draw(b, h, extra_topk, draw, pools, libs, args):
        res = dict(cute=dict(check=checks[draw], us=cute_us[draw], variant="split", schedule="device"),
                   flashmla=dict(check="ok", us=flash_us[draw]))
        if draw == 0:
            res["cute"]["transient_mib"], res["flashmla"]["transient_mib"] = 16.0, 48.0
        return res, 1e-4 * (draw + 1)
    return run_draw


def test_a_row_is_the_median_of_its_draws(monkeypatch):
    monkeypatch.setattr(bench_v4, "run_draw", _draws([80.0, 84.0, 79.0], [96.0, 101.0, 98.0]))
    r = bench_v4.run_row(128, 128, 1024, None, bench_v4.cute_mla, object(), SimpleNamespace(draws=3))
    assert (r["cute_us"], r["flashmla_us"]) == (80.0, 98.0)
    ratios = sorted([96 / 80, 101 / 84, 98 / 79])
    assert r["ratio"] == ratios[1] and (r["ratio_min"], r["ratio_max"]) == (ratios[0], ratios[2])
    assert r["cute_transient_mib"] == 16.0 and r["flashmla_transient_mib"] == 48.0 and r["cute_variant"] == "split"
    assert r["cute_check"] == "ok" and r["max_abs_diff_vs_flashmla"] == pytest.approx(3e-4) and len(r["draws"]) == 3


def test_a_failing_draw_fails_the_row(monkeypatch):
    monkeypatch.setattr(bench_v4, "run_draw", _draws([80.0, 84.0], [96.0, 101.0], ["ok", "out: 3 of 9 elements"]))
    r = bench_v4.run_row(128, 128, 1024, None, bench_v4.cute_mla, object(), SimpleNamespace(draws=2))
    assert r["cute_check"] == "out: 3 of 9 elements"


def test_without_flashmla_a_row_has_no_ratio(monkeypatch):
    def run_draw(b, h, extra_topk, draw, pools, libs, args):
        assert list(libs) == ["cute"]
        return dict(cute=dict(check="ok", us=50.0 + draw)), None
    monkeypatch.setattr(bench_v4, "run_draw", run_draw)
    r = bench_v4.run_row(32, 64, 512, None, bench_v4.cute_mla, None, SimpleNamespace(draws=3))
    assert r["cute_us"] == 51.0 and "ratio" not in r


def test_every_draw_of_every_row_has_its_own_seed():
    keys = [(b, h, e, d) for b in (*bench_v4.BATCHES, 1000, 4096) for h in bench_v4.HEADS
            for e in (*bench_v4.EXTRA_TOPKS, 2048) for d in range(99)]
    assert len({bench_v4.row_seed(*k) for k in keys}) == len(keys)


@pytest.mark.parametrize("cold", [False, True])
def test_the_table_prints_medians_and_ranges(monkeypatch, capsys, cold):
    monkeypatch.setattr(bench_v4, "run_draw", _draws([80.0, 84.0, 79.0], [96.0, 101.0, 98.0]))
    r = bench_v4.run_row(128, 128, 1024, None, bench_v4.cute_mla, object(), SimpleNamespace(draws=3))
    bench_v4.print_table([r], dict(gpu="GPU", commit="abc", draws=3, cold_l2=cold))
    out = capsys.readouterr().out
    assert " 128  128   1024 |     80.0   16.00     ok |        98.0   48.00     ok |   1.20  1.20-1.24   3.0e-04" in out
    assert ("L2 flushed" in out) == cold


def test_a_draw_that_raised_makes_the_row_an_error(monkeypatch):
    ok = _draws([80.0, 84.0, 79.0], [96.0, 101.0, 98.0])

    def run_draw(b, h, extra_topk, draw, pools, libs, args):
        res, diff = ok(b, h, extra_topk, draw, pools, libs, args)
        if draw == 2:
            res["cute"] = dict(error="RuntimeError: boom")
        return res, diff
    monkeypatch.setattr(bench_v4, "run_draw", run_draw)
    r = bench_v4.run_row(128, 128, 1024, None, bench_v4.cute_mla, object(), SimpleNamespace(draws=3))
    assert r["cute_error"] == "draw 2: RuntimeError: boom" and "cute_us" not in r and "ratio" not in r
    assert r["flashmla_us"] == 98.0
