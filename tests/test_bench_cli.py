"""CPU: ``cute-mla bench``'s help, its shape and variant parsing (one-line errors), the figure from
saved results (``--replot``), the fallback without matplotlib, and the one-line exit without a GPU."""

import json
import pathlib
import sys

import pytest
import torch

from cute_mla.cli import main
from cute_mla.formats import V4, V32
from cute_mla.kernels.sm90 import RegisterBudget, Sm90Tuning
from cute_mla.playground import bench

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def one_error_line(capsys):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("cute-mla bench: ") and "Traceback" not in err[0], err
    return err[0]


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())   # the help's wrapping aside
    for option in ("--shape", "--format", "--variant", "--vs", "--plot", "--json", "--replot", "--extra-topk"):
        assert option in out
    # the variant keys with their defaults, and the ceilings, from the one place each lives
    assert "prefetch_rows=true|false (default true)" in out and "registers=SOFTMAX/PV_RIGHT/PRODUCER" in out
    assert f"bf16 MMA {bench.BF16_MMA_TFLOPS:.0f} TFLOP/s" in out and f"{bench.COPY_TBPS} TB/s" in out


@pytest.mark.parametrize("text, fmt, shape", [("1x8192x128", V32, (1, 8192, 128)), ("128X2X128", V32, (128, 2, 128)),
                                              ("32x1x64", V4, (32, 1, 64))])
def test_shape_parses(text, fmt, shape):
    assert bench.parse_shape(text, fmt, 512 if fmt is V4 else 0) == bench.Shape(*shape)
    assert str(bench.Shape(*shape)) == "x".join(map(str, shape))


@pytest.mark.parametrize("argv, says", [
    (["--shape", "1x8192"], "--shape: expected B x S_Q x H_Q like 1x8192x128, got '1x8192'"),
    (["--shape", "1xax64"], "--shape: expected B x S_Q x H_Q"),
    (["--shape", "1x8x48"], "--shape 1x8x48: h_q: got 48, accepted: 8, 16, 32, 64 or 128"),
    (["--shape", "0x8x64"], "--shape 0x8x64: b: must be a positive int"),
    ([], "give at least one --shape"),
    (["--shape", "1x1x64", "--format", "v4", "--extra-topk", "100"], "--extra-topk: extra_topk: got 100"),
    (["--shape", "1x1x64", "--extra-topk", "512"], "--extra-topk: the V3.2 format has no extra KV pool"),
])
def test_bad_shape_is_one_line(capsys, argv, says):
    assert main(["bench"] + argv) == 2
    assert says in one_error_line(capsys)


@pytest.mark.parametrize("pairs, tuning", [
    ([], None),
    (["prefetch_rows=false"], Sm90Tuning(prefetch_rows=False)),
    (["prefetch-rows=Off", "h128_cluster=0"], Sm90Tuning(prefetch_rows=False, h128_cluster=False)),
    (["gather_l2="], Sm90Tuning(gather_l2="")),
    (["registers=208/168/128", "gather_l1=evict_normal"],
     Sm90Tuning(registers=RegisterBudget(208, 168, 128), gather_l1="evict_normal")),
    (["registers=144/112/128/2"], Sm90Tuning(registers=RegisterBudget(144, 112, 128, producers=2))),
])
def test_variant_parses(pairs, tuning):
    assert bench.parse_variant(pairs) == tuning


@pytest.mark.parametrize("pair, says", [
    ("foo=1", "unknown key 'foo'"),
    ("prefetch_rows", "expected KEY=VALUE"),
    ("prefetch_rows=maybe", "expected true or false, got 'maybe'"),
    ("registers=208/168", "expected SOFTMAX/PV_RIGHT/PRODUCER[/PRODUCERS], got '208/168'"),
    ("registers=256/256/128", "RegisterBudget: targets must be multiples of 8"),
    ("timeline=true", "timeline is instrumentation"),
])
def test_bad_variant_is_one_line_listing_the_keys(capsys, pair, says):
    assert main(["bench", "--shape", "1x8x64", "--variant", pair]) == 2
    line = one_error_line(capsys)
    assert says in line and "valid keys: gather_l1=STR" in line and "prefetch_rows=true|false" in line
    assert "timeline=" not in line.split("valid keys:")[1]


def test_variant_given_twice(capsys):
    assert main(["bench", "--shape", "1x8x64", "--variant", "prefetch_rows=false", "--variant", "prefetch_rows=true"]) == 2
    assert "prefetch_rows given twice" in one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_gpu_one_line(capsys):
    assert main(["bench", "--shape", "1x8192x128", "--vs", "flashmla"]) == 2
    line = one_error_line(capsys)
    assert "needs an SM90 or SM100 GPU" in line and "--replot" in line


def synthetic_results():
    """Two rows as ``cute-mla bench --json`` writes them (V3.2 and V4 shapes, a variant, FlashMLA)."""
    rows = []
    for fmt, (b, s_q, h), positions, us in ((V32, (1, 8192, 128), 2048, (9718.0, 9800.0, 12546.0)),
                                            (V4, (128, 1, 128), 128 + 512, (65.2, 66.0, 70.5))):
        flop, nbytes = bench.work(fmt, h, b * s_q, b * s_q * positions)
        row = dict(b=b, s_q=s_q, h_q=h, format=fmt.name, flop=flop, bytes=nbytes)
        for key, t in zip(("cute", "variant", "flashmla"), us):
            row.update({f"{key}_us": t, f"{key}_tflops": flop / t * 1e-6, f"{key}_check": "ok"})
        rows.append(row)
    meta = dict(tool="cute-mla bench", gpu="NVIDIA H200", format="V3.2", variant="prefetch_rows=False")
    return dict(meta=meta, results=rows)


@pytest.mark.parametrize("source", ["synthetic", "h200-a666f26.json", "h200-a666f26-v4.json"])
def test_replot_writes_a_png(tmp_path, capsys, source):
    """--replot plots saved results on any machine: this tool's JSON or the benchmarks' committed ones."""
    pytest.importorskip("matplotlib")
    if source == "synthetic":
        path = tmp_path / "results.json"
        path.write_text(json.dumps(synthetic_results()))
    else:
        path = RESULTS / source
    out = tmp_path / "fig.png"
    assert main(["bench", "--replot", str(path), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert f"figure: {out}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--replot", "x.json"], "--replot: give --plot OUT.png"),
    (["--replot", "/nonexistent/r.json", "--plot", "f.png"], "--replot /nonexistent/r.json: FileNotFoundError"),
])
def test_replot_errors_are_one_line(capsys, argv, says):
    assert main(["bench"] + argv) == 2
    assert says in one_error_line(capsys)


def test_replot_refuses_other_json(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    assert main(["bench", "--replot", str(path), "--plot", str(tmp_path / "f.png")]) == 2
    assert "not a results file" in one_error_line(capsys)


def test_plot_without_matplotlib_saves_results_and_says_how(tmp_path, capsys, monkeypatch):
    """The GPU machine has no matplotlib: the results go next to the figure's path and one line
    says how to plot them elsewhere; --replot of that file then draws the figure."""
    from cute_mla import cli

    d = synthetic_results()
    fig = tmp_path / "bench.png"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)      # import matplotlib raises ImportError
        assert cli._bench_plot(bench, d["meta"], d["results"], str(fig), replot=False) == 0
    out = capsys.readouterr().out.strip().splitlines()
    saved = tmp_path / "bench.json"
    assert len(out) == 1 and f"cute-mla bench --replot {saved} --plot {fig}" in out[0] and not fig.exists()
    assert json.loads(saved.read_text()) == d
    pytest.importorskip("matplotlib")
    assert main(["bench", "--replot", str(saved), "--plot", str(fig)]) == 0
    assert fig.read_bytes()[:8] == PNG_MAGIC


def test_accounting_matches_the_committed_results():
    """The work of a row (docs/performance.md section 2): the V3.2 grid's TFLOP/s as the benchmark
    wrote them, and the per-token numbers of that section."""
    d = json.loads((RESULTS / "h200-a666f26.json").read_text())
    for r in d["results"]:
        flop, _ = bench.row_work(r, d["meta"])
        assert flop / r["cute_us"] * 1e-6 == pytest.approx(r["cute_tflops"])
    assert bench.work(V32, 64, 1, 2048) == (2 * 64 * 1088 * 2048, 1491200)   # 285.2 M, 1.491 MB
    assert bench.work(V32, 128, 1, 2048)[1] == 1630720                       # 1.631 MB
    # the roof: copy-bound left of the ridge, MMA-bound right of it
    ridge = bench.BF16_MMA_TFLOPS / bench.COPY_TBPS
    assert bench.roof_tflops(ridge / 2) == pytest.approx(bench.BF16_MMA_TFLOPS / 2)
    assert bench.roof_tflops(ridge * 2) == bench.BF16_MMA_TFLOPS


def test_gathered_rows_counts_valid_positions_within_lengths():
    """The rows behind a row's achieved byte rate: valid indices only ([0, pool)), and with lengths
    only each request's first ``length`` positions (every query token of a request alike)."""
    idx = torch.tensor([[[0, -1, 5, bench.POOL]], [[1, 2, 3, 4]]], dtype=torch.int32)   # (b 2, s_q 1, k 4)
    assert bench.gathered_rows(idx) == 2 + 4
    assert bench.gathered_rows(idx, torch.tensor([2, 3], dtype=torch.int32)) == 1 + 3
    per_token = idx.expand(2, 3, 4)   # s_q 3: the lengths hold for each token of the request
    assert bench.gathered_rows(per_token, torch.tensor([4, 1], dtype=torch.int32)) == 3 * 2 + 3 * 1


def test_v4_layers_option_and_column(capsys):
    """``bench_sparse_decode --v4 --layers``: a --v4 option, and the table's per-call column of the
    many-call graph with the ratio's range over the draws."""
    from benchmarks import bench_sparse_decode as bsd
    assert bsd.parse_args(["--v4", "--layers"]).layers is True
    assert bsd.parse_args(["--v4"]).layers is False
    with pytest.raises(SystemExit):
        bsd.parse_args(["--layers"])
    row = dict(b=128, h_q=8, extra_topk=512, cute_us=26.8, cute_tflops=25.0, cute_tbps=0.89, cute_copy_share=0.3,
               cute_transient_mib=2.04, cute_check="ok", flashmla_us=52.3, flashmla_tflops=12.8,
               flashmla_transient_mib=39.6, flashmla_check="ok", ratio=1.95, ratio_min=1.86, ratio_max=1.96,
               max_abs_diff_vs_flashmla=2e-4, cute_layer_us=23.5, flashmla_layer_us=51.2, layer_ratio=2.18,
               layer_ratio_min=2.15, layer_ratio_max=2.2)
    meta = dict(gpu="GPU", commit="x", draws=5, cold_l2=False, copy_tbps=3.0, layers=True)
    bsd.v4_print_table([row], meta)
    out = capsys.readouterr().out
    assert f"per call in a {bsd.LAYER_CALLS}-call graph" in out and "23.5 / 51.2, 2.18 (2.15-2.20)" in out
