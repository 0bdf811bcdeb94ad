"""The sparse prefill benchmark's results files (no GPU): a case measured again adds a run, and a
row of several runs reports the median over them with the ratios' range."""

import json

import pytest

bench = pytest.importorskip("benchmarks.bench_sparse_prefill")


def _section(mode, rows, commit="abc1234", gpu="NVIDIA H100 80GB HBM3"):
    meta = dict(gpu=gpu, commit=commit, date="2026-12-06T00:00:00+00:00", iters=5, warmup=2, sample=16,
                command="python3 benchmarks/bench_sparse_prefill.py", mode=mode, s_q=4096,
                layout="strided (FlashMLA's)", topk_length=False, sm_scale=0.5, flashmla=True, variant=None)
    return {mode: dict(meta=meta, results=rows)}


def _row(case, cute_us, flashmla_us, check="ok"):
    r = dict(case=case, flop=1e12, bytes=1e9, cute_us=cute_us, flashmla_us=flashmla_us, cute_check=check,
             flashmla_check="ok", cute_transient_mib=0.0, flashmla_transient_mib=0.0,
             ratio=flashmla_us / cute_us, cute_tflops=1e6 / cute_us, flashmla_tflops=1e6 / flashmla_us,
             cute_host_us=60.0, flashmla_host_us=50.0, cute_gpu_us=cute_us - 60.0, flashmla_gpu_us=flashmla_us - 50.0,
             cute_gpu_exposed=0, flashmla_gpu_exposed=0, gpu_ratio=(flashmla_us - 50.0) / (cute_us - 60.0))
    r["runs"] = [bench.run_of(r)]
    return r


def test_a_case_run_again_adds_a_run_and_reports_the_median(tmp_path):
    d = str(tmp_path)
    bench.save(_section("cases", [_row("512/64/512/8192", 600.0, 660.0), _row("576/16/2048/65536", 2000.0, 3000.0)]), d)
    bench.save(_section("cases", [_row("512/64/512/8192", 700.0, 630.0, check="3 rows off")]), d)
    path, = tmp_path.glob("h100-abc1234-sparse-prefill.json")
    bench.save(_section("cases", [_row("512/64/512/8192", 650.0, 682.5)]), d)
    rows = {r["case"]: r for r in json.load(open(path))["cases"]["results"]}
    r = rows["512/64/512/8192"]
    assert len(r["runs"]) == 3 and len(rows["576/16/2048/65536"]["runs"]) == 1
    assert r["cute_us"] == 650.0 and r["flashmla_us"] == 660.0
    assert r["ratio"] == pytest.approx(1.05) and r["ratio_min"] == pytest.approx(0.9) and r["ratio_max"] == pytest.approx(1.1)
    assert r["cute_tflops"] == pytest.approx(1e12 / 650.0 * 1e-6)
    assert r["cute_check"] == "3 rows off"          # a failed run's check is kept
    md = (tmp_path / "h100-abc1234-sparse-prefill.md").read_text()
    assert "| 512/64/512/8192 | 650.0 |" in md and "1.050 (0.900-1.100, 3) |" in md
    assert "the ratio the median of the runs' ratios" in md
    assert "| 512/64/512/8192 | 590.0 | 610.0 | 1.072 (0.906-1.130, 3) |" in md      # GPU time: medians, ratio range


def test_a_failed_run_leaves_an_error_not_a_time(tmp_path):
    """A library that failed in one run of a case has its error in the row and no time or ratio
    (the table prints the error); the other library keeps its median."""
    d = str(tmp_path)
    bench.save(_section("cases", [_row("512/64/512/8192", 600.0, 660.0)]), d)
    failed = {k: v for k, v in _row("512/64/512/8192", 1.0, 630.0).items()
              if not k.startswith("cute_") or k == "cute_check"}
    failed["cute_error"] = "timing: RuntimeError: boom"
    failed["runs"] = [bench.run_of(failed)]
    bench.save(_section("cases", [failed]), d)
    path, = tmp_path.glob("*-sparse-prefill.json")
    r, = json.load(open(path))["cases"]["results"]
    assert r["cute_error"] == "timing: RuntimeError: boom" and "cute_us" not in r and "ratio" not in r
    assert not {"cute_host_us", "cute_gpu_us", "cute_gpu_exposed", "gpu_ratio"} & set(r)
    assert not any(k.startswith("cute_") or k == "gpu_ratio" for run in r["runs"] for k in run)
    assert r["flashmla_us"] == 645.0 and r["flashmla_gpu_us"] == 595.0 and len(r["runs"]) == 2
    md = (tmp_path / path.name.replace(".json", ".md")).read_text()
    assert "error: timing: RuntimeError: boom" in md and "GPU time of a call" not in md and "cute-mla 60.0 µs" not in md


def test_other_settings_replace_the_section(tmp_path):
    d = str(tmp_path)
    bench.save(_section("cases", [_row("512/64/512/8192", 600.0, 660.0)]), d)
    other = _section("cases", [_row("512/64/512/8192", 500.0, 660.0)])
    other["cases"]["meta"]["topk_length"] = True
    bench.save(other, d)
    path, = tmp_path.glob("*-sparse-prefill.json")
    r, = json.load(open(path))["cases"]["results"]
    assert len(r["runs"]) == 1 and r["cute_us"] == 500.0


def test_another_commit_starts_afresh_and_routes_rows_are_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "routes_table", lambda meta, rows: "")   # (the rows below are not whole)
    d = str(tmp_path)
    bench.save(_section("cases", [_row("512/64/512/8192", 600.0, 660.0)]), d)
    bench.save(_section("cases", [_row("512/64/512/8192", 500.0, 660.0)], commit="def5678"), d)
    path, = tmp_path.glob("*-sparse-prefill.json")
    assert path.name == "h100-def5678-sparse-prefill.json"
    r, = json.load(open(path))["cases"]["results"]
    assert len(r["runs"]) == 1 and r["cute_us"] == 500.0
    routes = [dict(case="576/128/2048/65536", workspace_mib=1.0)]
    bench.save(_section("routes", routes, commit="def5678"), d)
    bench.save(_section("routes", [dict(routes[0], workspace_mib=2.0)], commit="def5678"), d)
    doc = json.load(open(path))
    assert [r["workspace_mib"] for r in doc["routes"]["results"]] == [2.0] and "cases" in doc


def test_repeat_is_for_the_cases():
    assert bench.parse_args(["--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--routes", "--repeat", "2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])


def test_sustained_timing_adds_its_table_and_merges_by_run(tmp_path):
    """``--sustained`` rows: µs, mJ and MHz per library and the sustained ratio, merged over runs as
    the other timings are (medians, the ratio's range), in a table of their own."""
    def sus(row, cute, flashmla):
        row.update(cute_sus_us=cute, flashmla_sus_us=flashmla, cute_sus_mj=cute * 0.7, flashmla_sus_mj=flashmla * 0.7,
                   cute_sus_mhz=1500.0, flashmla_sus_mhz=1450.0, sus_ratio=flashmla / cute)
        row["runs"] = [bench.run_of(row)]
        return row

    d = str(tmp_path)
    section = _section("cases", [sus(_row("576/128/2048/32768", 4000.0, 4300.0), 4100.0, 4510.0)])
    section["cases"]["meta"]["sustained"] = 1.5
    bench.save(section, d)
    section = _section("cases", [sus(_row("576/128/2048/32768", 4000.0, 4300.0), 4000.0, 4320.0)])
    section["cases"]["meta"]["sustained"] = 1.5
    bench.save(section, d)
    path, = tmp_path.glob("*-sparse-prefill.json")
    r, = json.load(open(path))["cases"]["results"]
    assert r["cute_sus_us"] == 4050.0 and r["sus_ratio"] == pytest.approx((1.1 + 1.08) / 2)
    md = (tmp_path / "h100-abc1234-sparse-prefill.md").read_text()
    assert "Sustained time of a call (the calls back to back for about 1.5 s" in md
    assert "| 576/128/2048/32768 | 4050.0 | 2835 | 1500 | 4415.0 | 3090 | 1450 | 1.090 (1.080-1.100, 2) |" in md


def test_the_sustained_rounds_rotate_the_runners():
    """Each sustained round starts one runner later, so every runner takes every place once over
    as many rounds as runners (a fixed order would time the last runner always after the others)."""
    keys = ["cute", "flashmla", "variant"]
    orders = [bench.rotated(keys, r) for r in range(3)]
    assert orders[0] == keys and all(sorted(o) == keys for o in orders)
    assert all({o.index(k) for o in orders} == {0, 1, 2} for k in keys)
    assert bench.rotated([], 2) == []


def test_a_row_says_each_tuning_its_runs_ran(tmp_path):
    """The resolved tuning of cute-mla's runners is kept in the row and said under the table; runs
    of one case on different configs (a launcher keyed by less than its config) keep both."""
    d = str(tmp_path)
    first = {**_row("576/128/2048/65536", 600.0, 660.0), "cute_tuning": "prefetch_rows=True"}
    bench.save(_section("cases", [first]), d)
    bench.save(_section("cases", [{**_row("576/128/2048/65536", 610.0, 660.0), "cute_tuning": "prefetch_rows=True"}]), d)
    path, = tmp_path.glob("*-sparse-prefill.json")
    r, = json.load(open(path))["cases"]["results"]
    assert r["cute_tuning"] == "prefetch_rows=True"
    bench.save(_section("cases", [{**_row("576/128/2048/65536", 640.0, 660.0), "cute_tuning": "prefetch_rows=False"}]), d)
    bench.save(_section("cases", [{**_row("576/128/2048/65536", 640.0, 660.0), "cute_tuning": "prefetch_rows=True"}]), d)
    r, = json.load(open(path))["cases"]["results"]
    assert r["cute_tuning"] == "prefetch_rows=True / prefetch_rows=False"
    md = (tmp_path / "h100-abc1234-sparse-prefill.md").read_text()
    assert "576/128/2048/65536 prefetch_rows=True / prefetch_rows=False" in md
