"""CPU: ``cute-mla warmup`` precompiles exactly what the dispatcher can pick: every plan's decode
and combine configs (the launcher's ``launch_configs``) are among ``warmup.variants``."""

import itertools

import pytest

from cute_mla import archs, plan_sparse_decode, warmup
from cute_mla.cli import main
from cute_mla.dsl import compile as dc
from cute_mla.interface.launcher import launch_configs

SHAPES = [(1, 1), (1, 8), (1, 128), (1, 8192), (4, 1), (32, 1), (74, 3), (128, 1), (128, 2), (321, 1), (512, 1),
          (3, 40), (1, 67)]
LISTS = [(576, 2048, 0), (576, 64, 0), (512, 128, 0), (512, 128, 512), (512, 128, 1024), (512, 2048, 1024)]


@pytest.mark.parametrize("arch", archs.SUPPORTED_ARCHS)
def test_every_plan_configuration_is_warmed(arch):
    spec = archs.get(arch)
    warmed = warmup.variants(arch)
    warmed_decode = {cfg for kind, cfg in warmed if kind == "sparse_decode"}
    warmed_combine = {cfg.cache_key for kind, cfg in warmed if kind == "combine"}
    checked = 0
    for (b, s_q), h_q, (d_qk, topk, extra), tl, xtl, sink in itertools.product(
            SHAPES, (64, 128), LISTS, (False, True), (False, True), (False, True)):
        if xtl and not extra:
            continue
        plan = plan_sparse_decode(b, s_q, h_q, d_qk, topk, arch=arch, num_sms=spec.default_num_sms, has_topk_length=tl,
                                  extra_topk=extra, has_extra_topk_length=xtl)
        assert plan.format == ("V4" if d_qk == 512 else "V3.2")
        main_cfg, combine_cfg = launch_configs(plan, sink)
        assert main_cfg in warmed_decode, (b, s_q, h_q, d_qk, topk, extra, tl, xtl, sink, main_cfg)
        if combine_cfg is not None:
            assert combine_cfg.cache_key in warmed_combine, (b, s_q, h_q, plan.num_sm_parts, combine_cfg)
        checked += 1
    assert checked > 900


def test_kinds_are_checked():
    with pytest.raises(ValueError, match="kinds"):
        warmup.variants("sm_90a", kinds=("decoder",))
    decode = warmup.variants("sm_90a", kinds=("decode",), formats=("V4",), h_qs=(64,))
    assert decode == warmup.variants("sm_90a", kinds=("sparse_decode",), formats=("V4",), h_qs=(64,))
    assert decode and all(k == "sparse_decode" and cfg.format == "V4" and cfg.h_q == 64 for k, cfg in decode)


def test_default_heads_are_each_ops_own():
    """Without ``h_qs`` each op warms every head count its arch's kernel takes natively: on SM90 8,
    16 and 32 heads too (the swap-AB tile, both ops), on SM100 the decode kernel 64 and 128."""
    assert {cfg.h_q for _, cfg in warmup.variants("sm_90a", op="sparse_prefill")} == {8, 16, 32, 64, 128}
    assert {cfg.h_q for _, cfg in warmup.variants("sm_90a", kinds=("sparse_decode",))} == {8, 16, 32, 64, 128}
    assert {cfg.h_q for _, cfg in warmup.variants("sm_100a", kinds=("sparse_decode",))} == {64, 128}
    # a config's default tuning is resolved for its shape, and still reads as the default
    for op in ("sparse_prefill", "sparse_decode"):
        tuned = [warmup.describe(v) for v in warmup.variants("sm_90a", op=op) if "tuning" in warmup.describe(v)]
        # the one plan rule past the shape's: 576/128 prefill with kv rows in the L2 leaves out the row prefetch
        assert all(" h_q=128 d_qk=576 " in d and d.endswith("tuning(prefetch_rows=False)") for d in tuned), tuned
        assert len(tuned) == (4 if op == "sparse_prefill" else 0)


def test_warmup_command_fills_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(dc.CACHE_ENV, str(tmp_path))
    assert main(["warmup", "--arch", "sm_90a", "--kinds", "scheduler", "--progress"]) == 0
    out = capsys.readouterr().out
    assert "[1/1] scheduler: compiled in" in out and "1 kernels for sm_90a in the compile cache" in out
    assert len(list(dc.cache_dir().glob("*.o"))) == 1
    assert main(["warmup", "--arch", "sm_90a", "--kinds", "scheduler", "--progress"]) == 0
    assert "[1/1] scheduler: loaded in" in capsys.readouterr().out
    assert main(["warmup", "--arch", "sm_90a", "--kinds", "scheduler", "--no-progress"]) == 0
    assert "[1/1]" not in capsys.readouterr().out
    monkeypatch.setenv(dc.CACHE_ENV, "off")
    assert main(["warmup", "--arch", "sm_90a", "--kinds", "scheduler"]) == 2
    assert "compile cache is off" in capsys.readouterr().err


def test_an_unwritable_cache_is_one_error_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(dc.CACHE_ENV, str(blocker / "cache"))
    assert main(["warmup", "--arch", "sm_90a", "--kinds", "scheduler"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cute-mla warmup: the compile cache") and "cannot be written" in err[0]


def test_progress_lines_name_the_variant():
    kernel, cfg = next(v for v in warmup.variants("sm_90a", h_qs=(128,), formats=("V4",), kinds=("sparse_decode",))
                       if v[1].has_extra and v[1].request_order)
    line = warmup.describe((kernel, cfg))
    assert line.startswith("sparse_decode h_q=128") and "format=V4" in line and "request_order" in line
