import json
import os

import pytest

from cute_mla.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "nvidia-cutlass-dsl 4.8.1" in out and "sm_90a, sm_100a" in out


@pytest.mark.parametrize("s_q,parts,rows", [(1, 132, 32), (8, 16, 16), (128, 1, 0), (1024, 1, 0), (8192, 1, 0), (32768, 1, 0)])
def test_plan_acceptance_grid(capsys, s_q, parts, rows):
    assert main(["plan", "--b", "1", "--s-q", str(s_q), "--h-q", "64", "--topk", "2048", "--arch", "sm_90a", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["num_sm_parts"] == parts and p["accum_rows"] == rows
    # s_q above one wave of CTAs: the token walk over 132 partitions of whole tokens
    assert p["token_walk"] == (s_q > 132) and p["partitions"] == (132 if s_q > 132 else parts)
    assert p["workspace_bytes"] == rows * s_q * 64 * 1028   # bf16 o_accum (512 x 2 B) + fp32 lse_accum
    assert p["accum_dtype"] == ("bfloat16" if rows else "float32")
    assert (p["variant"] == "no_split") == (rows == 0)
    # bf16 partials: staged and stored by TMA (an o_accum tensor map), in the column pair too
    assert ("o_accum" in p["tensor_maps"]) == (rows > 0)
    # the column pair (s_q=1: 32 one-block pieces) stores out from registers too
    assert p["column_pair"] == (s_q == 1)
    assert ("out" in p["tensor_maps"]) == (s_q != 1)


def test_plan_human_readable(capsys):
    assert main(["plan", "--b", "1", "--s-q", "32768", "--h-q", "64", "--topk", "2048", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "workspace: 0 bytes" in out and "FlashMLA would allocate: 8208.00 MiB" in out


def test_plan_bad_argument_exit_code(capsys):
    assert main(["plan", "--h-q", "48"]) == 2
    assert "h_q: got 48" in capsys.readouterr().err


def test_demo_without_gpu(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "No supported GPU" in out and "reference on" in out


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kernel", ["combine", "scheduler"])
def test_compile_small_kernels(tmp_path, capsys, arch, kernel):
    assert main(["compile", "--arch", arch, "--kernel", kernel, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert any(f.endswith(".ptx") and f.startswith(f"{kernel}-{arch}-") for f in os.listdir(tmp_path))
    assert "registers" in out or "cuobjdump not found" in out
    if kernel == "combine":   # the partials' dtype the plans of that arch use: bf16 rows on SM90, fp32 on SM100
        ptx = next(f for f in os.listdir(tmp_path) if f.endswith(".ptx"))
        text = open(os.path.join(tmp_path, ptx)).read()
        assert ("ld.global.v2.b32" in text and "ld.global.v4" not in text) if arch == "sm_90a" else "ld.global.v4" in text


def test_compile_unknown_kernel(tmp_path, capsys):
    """--kernel is a choice list (argparse names the choices)."""
    with pytest.raises(SystemExit) as e:
        main(["compile", "--arch", "sm_90a", "--kernel", "nope", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kernel: invalid choice: 'nope'" in err and "sparse_decode" in err


@pytest.mark.parametrize("arch,extra", [("sm_90a", []), ("sm_90a", ["--split", "--h-q", "128"]), ("sm_100a", ["--split"])])
def test_compile_sparse_decode(tmp_path, capsys, arch, extra):
    assert main(["compile", "--arch", arch, "--kernel", "sparse_decode", "--out", str(tmp_path)] + extra) == 0
    out = capsys.readouterr().out
    ptx = [f for f in os.listdir(tmp_path) if f.endswith(".ptx") and f.startswith(f"sparse_decode-{arch}-")]
    assert ptx
    text = open(os.path.join(tmp_path, ptx[0])).read()
    assert ("wgmma.mma_async" in text) if arch == "sm_90a" else ("tcgen05.mma" in text)
    if "registers" in out:
        assert "local 0 B" in out


@pytest.mark.parametrize("argv, says", [
    (["plan", "--num-sms", "0"], "--num-sms: expected a positive integer, got 0"),
    (["plan", "--b", "-3"], "--b: expected a positive integer, got -3"),
])
def test_counts_must_be_positive(capsys, argv, says):
    """argparse refuses a zero or negative count (it once fell back to the default SM count)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_plan_refuses_impossible_sizes_at_once(capsys):
    """A billion requests of a million tokens: refused with the limits, not planned until memory runs out."""
    assert main(["plan", "--b", "1000000000", "--s-q", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "b <= 1048576" in err and "b * s_q <= 2147483647" in err


@pytest.mark.parametrize("kernel, flag", [("combine", ["--split"]), ("combine", ["--topk-length"]),
                                          ("combine", ["--d-qk", "512"]), ("combine", ["--format", "V4"]),
                                          ("combine", ["--extra-kv"]), ("combine", ["--extra-topk", "512"]),
                                          ("combine", ["--variant", "prefetch_rows=false"]),
                                          ("scheduler", ["--h-q", "128"]), ("scheduler", ["--attn-sink"])])
def test_compile_refuses_options_the_kernel_ignores(tmp_path, capsys, kernel, flag):
    assert main(["compile", "--arch", "sm_90a", "--kernel", kernel, "--out", str(tmp_path)] + flag) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]}: options of --kernel sparse_decode, which --kernel {kernel} does not take" in err, err


@pytest.mark.parametrize("argv, says", [
    (["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--extra-kv"],
     "--extra-kv: the V3.2 format has no extra KV pool"),
    (["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--extra-topk", "512"],
     "--extra-topk: the V3.2 format has no extra KV pool"),
    (["plan", "--extra-topk", "512"], "--extra-topk: the V3.2 format has no extra KV pool"),
    (["plan", "--format", "V4", "--extra-topk-length"], "--extra-topk-length: needs the extra pool"),
    (["plan", "--format", "V4", "--d-qk", "576"], "--d-qk 576: the V3.2 format's width, but --format names V4"),
    (["plan", "--format", "V41"], "format: V41 is not implemented yet"),
    (["plan", "--d-qk", "600"], "--d-qk: got 600"),
])
def test_errors_name_the_flag_the_user_typed(tmp_path, capsys, argv, says):
    if argv[0] == "compile":
        argv = argv + ["--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_plan_names_the_format_and_op(capsys):
    assert main(["plan", "--format", "V4", "--b", "128", "--h-q", "128", "--topk", "128", "--extra-topk", "512",
                 "--topk-length", "--extra-topk-length", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["op"], p["format"], p["d_qk"], p["schedule"]) == ("sparse_decode", "V4", 512, "device")
    assert main(["plan", "--d-qk", "512", "--b", "128", "--h-q", "128", "--topk", "128", "--extra-topk", "512",
                 "--topk-length", "--extra-topk-length", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == p


def test_ops_prints_the_registry(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "sparse_decode:" in out and "sm90_sparse_decode" in out and "cute_mla.kernels.sm100.sparse_decode" in out


def test_every_option_has_help():
    import argparse

    from cute_mla.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, sp in sub.choices.items() for a in sp._actions
               if a.option_strings and a.help is None and a.dest != "help"]
    assert not missing, missing


def test_compile_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["compile", "--arch", "sm_90a", "--kernel", "scheduler", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cute-mla compile:") and "Traceback" not in err[0]


def test_compile_keeps_variants_apart_and_reports_resources(tmp_path, capsys):
    """Split, sink and no-split variants compiled into one directory keep their own files, named
    <kernel>-<arch>-<variant>; the report has the dynamic shared memory and the instruction mix."""
    out = str(tmp_path)
    assert main(["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--out", out]) == 0
    assert main(["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--out", out, "--split", "--attn-sink",
                 "--format", "V4", "--extra-topk", "512"]) == 0
    text = capsys.readouterr().out
    names = sorted(f for f in os.listdir(out) if not f.startswith("."))
    assert names == ["sparse_decode-sm_90a-h64-nosplit.cubin", "sparse_decode-sm_90a-h64-nosplit.ptx",
                     "sparse_decode-sm_90a-h64-split-v4-extra-sink.cubin", "sparse_decode-sm_90a-h64-split-v4-extra-sink.ptx"]
    assert "dynamic shared memory 231424 B" in text and "dynamic shared memory 206848 B" in text.split("split-v4")[-1]
    assert "PTX: wgmma 80" in text and "PTX: wgmma 72" in text


def test_compile_a_variant(tmp_path, capsys):
    """--variant compiles an Sm90Tuning variant (bench's key=value syntax) into its own files; the
    variant's PTX differs where the knob acts (no L2 row prefetch: no prefetch.global.L2)."""
    out = str(tmp_path)
    assert main(["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--out", out]) == 0
    assert main(["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--out", out,
                 "--variant", "prefetch_rows=false"]) == 0
    base = open(os.path.join(out, "sparse_decode-sm_90a-h64-nosplit.ptx")).read()
    var = open(os.path.join(out, "sparse_decode-sm_90a-h64-nosplit-prefetch_rows_false.ptx")).read()
    assert "prefetch.global.L2" in base and "prefetch.global.L2" not in var
    capsys.readouterr()
    assert main(["compile", "--arch", "sm_100a", "--kernel", "sparse_decode", "--out", out,
                 "--variant", "prefetch_rows=false"]) == 2
    assert main(["compile", "--arch", "sm_90a", "--kernel", "sparse_decode", "--out", out, "--variant", "bogus=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "sm100_sparse_decode kernel (sm_100a) has no variant knobs" in err[0], err
    assert "unknown key 'bogus'" in err[1], err


def test_warmup_all_ops_warms_every_op_of_the_arch(monkeypatch, capsys):
    """``warmup --op all``: each op registered for the arch, once; ``--kinds`` needs one op."""
    from cute_mla import registry, warmup

    seen = []
    monkeypatch.setattr(warmup, "warmup", lambda arch, op, **kw: seen.append((arch, op)) or 1)
    assert main(["warmup", "--op", "all", "--arch", "sm_90a"]) == 0
    assert seen == [("sm_90a", op) for op in registry.OPS]
    assert f"{len(registry.OPS)} kernels for sm_90a" in capsys.readouterr().out
    assert main(["warmup", "--op", "all", "--arch", "sm_90a", "--kinds", "combine"]) == 2
    assert "--kinds: names one op's kernels" in capsys.readouterr().err
