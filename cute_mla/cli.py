"""The ``cute-mla`` command: info, ops, plan, compile, warmup, demo, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata

from . import archs, registry, warmup


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args) -> int:
    import torch

    from . import __version__
    from .archs import SUPPORTED_ARCHS, gpu_summary

    print(f"cute-mla           {__version__}")
    print(f"python             {sys.version.split()[0]}")
    print(f"torch              {torch.__version__}")
    print(f"nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}")
    print(f"apache-tvm-ffi     {_version('apache-tvm-ffi')}")
    print(f"gpu                {gpu_summary() or 'none (kernels compile for any arch; running them needs SM90 or SM100)'}")
    print(f"supported archs    {', '.join(SUPPORTED_ARCHS)}")
    return 0


def cmd_ops(args) -> int:
    print(registry.describe())
    return 0


def _format_of(name=None, d_qk=None):
    """The format ``--format NAME`` or the width ``--d-qk N`` names (the one implemented format of
    that width), its errors naming the flag."""
    from .formats import format_for_d_qk, format_named

    try:
        return format_named(name) if d_qk is None else format_for_d_qk(d_qk)
    except (ValueError, NotImplementedError) as e:
        flag = "--format" if d_qk is None else "--d-qk"
        raise type(e)(f"{flag}: {str(e).split(': ', 1)[1]}") from None


def _format_arg(args):
    """The format a command names: ``--format NAME``, or the width ``--d-qk N`` names; both given
    must agree. None: neither given."""
    fmt = None if args.format is None else _format_of(name=args.format)
    if args.d_qk is not None:
        by_width = _format_of(d_qk=args.d_qk)
        if fmt is not None and fmt is not by_width:
            raise ValueError(f"--d-qk {args.d_qk}: the {by_width.name} format's width, but --format names {fmt.name}")
        fmt = by_width
    return fmt


def _check_extra_pool(fmt, flag, extra_topk_length: bool = False) -> None:
    """The extra-pool options against the format: ``flag``, the option that asked for the pool (None:
    none did), and ``--extra-topk-length``, which needs it."""
    if flag is None:
        if extra_topk_length:
            raise ValueError("--extra-topk-length: needs the extra pool (--extra-topk N)")
    elif not fmt.extra_pool:
        from .formats import supported_formats

        with_pool = ", ".join(f.name for f in supported_formats() if f.extra_pool)
        raise ValueError(f"{flag}: the {fmt.name} format has no extra KV pool; formats with one: {with_pool}")


def _plan_from_args(args, s_q=None):
    from .formats import V32

    plan_call = registry.plan_function(args.op)
    fmt = _format_arg(args) or V32
    if args.op == registry.SPARSE_PREFILL.name:
        _refuse_options(args.op, (("--b", args.b != 1), ("--extra-topk", bool(args.extra_topk)),
                                  ("--extra-topk-length", args.extra_topk_length)))
        return plan_call(s_q or args.s_q, args.h_q, fmt.d_qk, args.topk, arch=args.arch,
                         has_topk_length=args.topk_length, s_kv=getattr(args, "s_kv", None))
    _refuse_options(args.op, (("--s-kv", getattr(args, "s_kv", None) is not None),))
    _check_extra_pool(fmt, "--extra-topk" if args.extra_topk else None, args.extra_topk_length)
    num_sms = archs.get(args.arch).default_num_sms if args.num_sms is None else args.num_sms
    return plan_call(args.b, s_q or args.s_q, args.h_q, fmt.d_qk, args.topk, arch=args.arch, num_sms=num_sms,
                     has_topk_length=args.topk_length, extra_topk=args.extra_topk,
                     has_extra_topk_length=args.extra_topk_length, format=fmt.name)


def _refuse_options(op: str, given) -> None:
    """Options an op does not take, named: ``given`` is (flag, given) pairs."""
    named = [flag for flag, on in given if on]
    if named:
        raise ValueError(f"{', '.join(named)}: not an option of --op {op}")


def cmd_plan(args) -> int:
    plan = _plan_from_args(args)
    if args.json and plan.op == registry.SPARSE_PREFILL.name:
        d = {k: getattr(plan, k) for k in ("op", "arch", "s_q", "h_q", "d_qk", "topk", "has_topk_length", "s_kv",
                                           "kv_fits_l2", "kernel", "kernel_h_q", "tile", "padded", "split",
                                           "workspace_bytes", "padding_bytes", "items")}
        d["tensor_maps"] = list(plan.tensor_maps)
        print(json.dumps(d, indent=2))
    elif args.json:
        d = {k: getattr(plan, k) for k in ("op", "arch", "format", "b", "s_q", "h_q", "d_qk", "topk", "has_topk_length",
                                           "extra_topk", "has_extra_topk_length", "num_sm_parts",
                                           "kernel", "variant", "schedule", "accum_rows", "workspace_bytes",
                                           "flashmla_workspace_bytes", "token_walk", "column_pair", "accum_dtype")}
        # the partitions the kernel launches (num_sm_parts is FlashMLA's count; the token walk differs)
        d["partitions"] = len(plan.host_schedule.rows) if plan.host_schedule is not None else plan.num_sm_parts
        d["tensor_maps"] = list(plan.tensor_maps)
        d["launches"] = list(plan.launches)
        print(json.dumps(d, indent=2))
    else:
        print(plan.describe())
    return 0


def cmd_compile(args) -> int:
    from .formats import V32
    from .playground import registry as playground

    main_kernel = registry.op(args.op).name
    if args.kernel is None:
        args.kernel = main_kernel
    fmt = _format_arg(args)
    if args.op == registry.SPARSE_PREFILL.name:
        _refuse_options(args.op, (("--split", args.split), ("--extra-topk", bool(args.extra_topk)),
                                  ("--extra-kv", args.extra_kv), ("--extra-topk-length", args.extra_topk_length)))
    if args.extra_topk < 0:
        raise ValueError(f"--extra-topk: got {args.extra_topk}, accepted: 0 (no extra pool) or N > 0")
    extra_flag = "--extra-kv" if args.extra_kv else "--extra-topk" if args.extra_topk else None
    if args.kernel != main_kernel:
        given = [flag for flag, on in (("--split", args.split), ("--topk-length", args.topk_length),
                                       ("--format" if args.format else "--d-qk", fmt is not None),
                                       (extra_flag, extra_flag is not None),
                                       ("--extra-topk-length", args.extra_topk_length),
                                       ("--variant", bool(args.variant))) if on]
        if args.kernel == "scheduler":
            given += [flag for flag, on in (("--h-q", args.h_q is not None), ("--attn-sink", args.attn_sink)) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: options of --kernel {main_kernel}, which --kernel {args.kernel} "
                             "does not take")
    fmt = fmt or V32
    _check_extra_pool(fmt, extra_flag, args.extra_topk_length)

    t0 = time.time()
    report = playground.compile_to_dir(args.kernel, args.arch, args.out, op=args.op, h_q=args.h_q or 64,
                                       split=args.split, has_topk_length=args.topk_length, has_attn_sink=args.attn_sink,
                                       format=fmt.name, has_extra=extra_flag is not None,
                                       has_extra_topk_length=args.extra_topk_length, variant=args.variant)
    print(f"compiled {args.kernel} for {args.arch} in {time.time() - t0:.1f} s -> {args.out}")
    for line in report:
        print(line)
    return 0


def cmd_warmup(args) -> int:
    from .dsl.compile import cache_dir

    formats = None
    if args.format is not None or args.d_qk is not None:
        named = [_format_of(name=f) for f in args.format or ()] + [_format_of(d_qk=d) for d in args.d_qk or ()]
        formats = tuple(dict.fromkeys(f.name for f in named))   # each once
    progress = sys.stdout.isatty() if args.progress is None else args.progress
    t0 = time.time()
    ops = tuple(op for op in registry.OPS if args.arch in registry.op(op).kernels) if args.op == ALL_OPS else (args.op,)
    if args.op == ALL_OPS and args.kinds is not None:
        raise ValueError("--kinds: names one op's kernels; give it with --op OP, not --op all")
    n = sum(warmup.warmup(args.arch, h_qs=args.h_q, formats=formats, kinds=args.kinds, jobs=args.jobs, op=op,
                          progress=(lambda line: print(line, flush=True)) if progress else None) for op in ops)
    print(f"{n} kernels for {args.arch} in the compile cache {cache_dir()} ({time.time() - t0:.0f} s)")
    return 0


ALL_OPS = "all"   # warmup --op all: every op registered for the arch


def _int_list(text: str):
    return tuple(positive_int(v) for v in text.split(",") if v)


def cmd_demo(args) -> int:
    from . import demo

    return demo.main(args)


def cmd_bench(args) -> int:
    from .archs import UnsupportedDeviceError, device_spec, gpu_summary
    from .playground import bench

    if args.replot:
        if not args.plot:
            raise ValueError("--replot: give --plot OUT.png, the figure to write")
        meta, rows = bench.load(args.replot)
        return _bench_plot(bench, meta, rows, args.plot, replot=True)
    if not args.shape:
        raise ValueError("give at least one --shape BxS_QxH_Q (e.g. --shape 1x8192x128), or --replot RESULTS.json")
    registry.op(args.op)
    fmt = bench.format_named(args.format)
    if args.extra_topk is not None:
        _check_extra_pool(fmt, "--extra-topk")
    extra = bench.check_extra_topk(bench.V4_EXTRA_TOPK if args.extra_topk is None else args.extra_topk) \
        if fmt.extra_pool else 0
    shapes = [bench.parse_shape(s, fmt, extra) for s in args.shape]
    tuning = bench.parse_variant(args.variant)
    try:
        if gpu_summary() is None:
            raise UnsupportedDeviceError("this machine has none")
        device_spec("cuda")
    except UnsupportedDeviceError as e:
        print(f"cute-mla bench: needs an SM90 or SM100 GPU; {e} (--replot RESULTS.json --plot OUT.png plots saved "
              "results on any machine)", file=sys.stderr)
        return 2
    meta, rows = bench.run(shapes, fmt, tuning=tuning, vs_flashmla=args.vs == "flashmla", extra_topk=extra,
                           sample=args.sample, warmup_s=args.warmup_s,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    meta["command"] = " ".join(["cute-mla bench", *(f"--shape {s}" for s in args.shape), f"--format {args.format}",
                                *([f"--extra-topk {extra}"] if fmt.extra_pool else []),
                                *(f"--variant {v}" for v in args.variant), *([f"--vs {args.vs}"] if args.vs else [])])
    print(bench.table(meta, rows))
    if args.json:
        bench.save(args.json, meta, rows)
        print(f"results: {args.json}")
    rc = 0
    if args.plot:
        rc = _bench_plot(bench, meta, rows, args.plot, replot=False, saved=args.json)
    bad = bench.failed(rows)
    for line in bad:
        print(f"cute-mla bench: {line}", file=sys.stderr)
    return 1 if bad else rc


def _bench_plot(bench, meta, rows, path, replot, saved=None) -> int:
    """The figure, or (no matplotlib) the results saved next to it and how to plot them elsewhere."""
    try:
        bench.plot(meta, rows, path)
    except ImportError:
        if replot:
            raise ValueError("--replot: matplotlib is not installed here (pip install matplotlib)") from None
        if saved is None:
            saved = bench.companion_json(path)
            bench.save(saved, meta, rows)
        print(f"matplotlib is not installed here; results in {saved}: plot them on any machine with "
              f"cute-mla bench --replot {saved} --plot {path}")
        return 0
    print(f"figure: {path}")
    return 0


def positive_int(text: str) -> int:
    """argparse type: a positive integer (a count of requests, tokens, heads, positions or SMs)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _paragraphs(text: str) -> str:
    """``text``'s paragraphs wrapped for a help page that keeps line breaks (its examples)."""
    import textwrap

    return "\n\n".join(textwrap.fill(p, 100) for p in text.split("\n\n"))


def build_parser() -> argparse.ArgumentParser:
    from .formats import supported_formats

    p = argparse.ArgumentParser(prog="cute-mla", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    formats = ", ".join(f"{f.name} (d_qk {f.d_qk})" for f in supported_formats())
    ops = tuple(registry.OPS)
    kernels = tuple(dict.fromkeys(k for op in registry.OPS.values() for k in op.kernel_names()))

    sub.add_parser("info", help="versions, the GPU, supported archs").set_defaults(fn=cmd_info)
    sub.add_parser("ops", help="the op registry: each op's API, plan and kernel per arch").set_defaults(fn=cmd_ops)

    def op_arg(sp, all_ops=False):
        sp.add_argument("--op", default=registry.DEFAULT_OP, choices=ops + ((ALL_OPS,) if all_ops else ()),
                        help=f"the op (default {registry.DEFAULT_OP}" + (f"; {ALL_OPS}: every op" if all_ops else "") + ")")

    def format_args(sp, many=False):
        if many:
            sp.add_argument("--format", type=lambda t: tuple(t.split(",")), default=None,
                            help=f"cache formats, comma-separated: {formats}; default all")
            sp.add_argument("--d-qk", type=_int_list, default=None, help=argparse.SUPPRESS)   # the formats by width
        else:
            sp.add_argument("--format", default=None, help=f"the cache format: {formats} (default V3.2)")
            sp.add_argument("--d-qk", type=positive_int, default=None,
                            help="the key width, 576 or 512 (sparse_prefill's choice; sparse_decode: the format of that width)")

    def variant_args(sp):
        """The options a plan and a kernel variant share."""
        sp.add_argument("--topk-length", action="store_true", help="per-request topk_length (device lengths)")
        sp.add_argument("--extra-topk-length", action="store_true",
                        help="per-request extra_topk_length (the extra pool's device lengths)")

    sp = sub.add_parser("plan", help="print the plan of a call: kernel, variant, workspace, tensor maps")
    op_arg(sp)
    format_args(sp)
    sp.add_argument("--h-q", type=positive_int, default=64,
                    help="query heads: 8, 16, 32, 64 or 128 (the arch's kernel decides; default 64)")
    variant_args(sp)
    sp.add_argument("--b", type=positive_int, default=1, help="requests (default 1)")
    sp.add_argument("--s-q", type=positive_int, default=1, help="query tokens per request (default 1)")
    sp.add_argument("--topk", type=positive_int, default=2048, help="the main top-k list's length (default 2048)")
    sp.add_argument("--s-kv", type=positive_int, default=None,
                    help="sparse_prefill: kv's rows (whether they fit the L2 picks a kernel knob; default unknown)")
    sp.add_argument("--extra-topk", type=int, default=0,
                    help="the extra KV pool's list length, a multiple of 64 (V4; default 0: no extra pool)")
    sp.add_argument("--arch", default=archs.SM90.name, choices=archs.SUPPORTED_ARCHS, help="default %(default)s")
    sp.add_argument("--num-sms", type=positive_int, default=None, help="SMs to plan for; default: " + ", ".join(
        f"{a.default_num_sms} for {a.name}" for a in archs.ARCHS.values()))
    sp.add_argument("--json", action="store_true", help="the plan as JSON")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("compile", help="compile a kernel for an arch (no GPU needed); write PTX and cubin; print resources")
    op_arg(sp)
    sp.add_argument("--arch", required=True, choices=archs.SUPPORTED_ARCHS, help="the compile target")
    sp.add_argument("--kernel", default=None, choices=kernels,
                    help="the op's main kernel (its name; the default) or one of its helper kernels")
    sp.add_argument("--out", required=True, help="directory for the PTX and cubin")
    format_args(sp)
    sp.add_argument("--h-q", type=positive_int, default=None,
                    help="query heads: 8, 16, 32, 64 or 128 (SM90; SM100: 64 or 128; default 64)")
    variant_args(sp)
    sp.add_argument("--split", action="store_true", help="the split variant (writes split-KV partials)")
    sp.add_argument("--attn-sink", action="store_true", help="the variant that takes attn_sink")
    sp.add_argument("--extra-topk", type=int, default=0, metavar="N",
                    help="the extra KV pool (V4): any N > 0 compiles the variant that reads it")
    sp.add_argument("--extra-kv", action="store_true", help=argparse.SUPPRESS)   # --extra-topk's older spelling
    sp.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="a kernel variant (its Tuning fields, as cute-mla bench takes them; repeat for several)")
    sp.set_defaults(fn=cmd_compile)

    sp = sub.add_parser("warmup", help="precompile every kernel variant the plans can pick into the disk cache (no GPU)")
    op_arg(sp, all_ops=True)
    sp.add_argument("--arch", required=True, choices=archs.SUPPORTED_ARCHS, help="the compile target")
    sp.add_argument("--h-q", type=_int_list, default=None,
                    help="head counts, e.g. 64,128 (default: every head count the op takes)")
    format_args(sp, many=True)
    sp.add_argument("--kinds", type=lambda t: tuple(t.split(",")), default=None,
                    help="the op's kernels to warm, comma-separated (sparse_decode: sparse_decode or decode, combine, "
                         "scheduler); default all")
    sp.add_argument("--jobs", type=positive_int, default=1, help="compiling processes (default 1)")
    sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="a line per kernel: what it is, loaded or compiled (default: on a terminal)")
    sp.set_defaults(fn=cmd_warmup)

    sp = sub.add_parser("demo", help="run a realistic sparse decode (GPU) or show plans and the reference (CPU)")
    sp.add_argument("--quick", action="store_true", help="smaller shapes")
    sp.set_defaults(fn=cmd_demo)

    from .playground import bench
    sp = sub.add_parser(
        "bench", help="check against the reference, then time cute-mla, a kernel variant and FlashMLA side by side (GPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs("Per shape: (1) cute-mla (and the variant, and FlashMLA with --vs flashmla) checked against the "
                    "fp32 reference on a sample of query tokens, with FlashMLA's tolerances; (2) each timed by CUDA "
                    "graph replay, interleaved; (3) a table: µs, TFLOP/s, speed-up against FlashMLA and against "
                    "cute-mla's default, transient MiB. Exit status 1 if a cute-mla kernel fails its check.\n\n"
                    f"Inputs: V3.2 top-k {bench.V32_TOPK} with {bench.V32_MASKED:.0%} of the indices -1; V4 top-k "
                    f"{bench.V4_TOPK} with topk_length, an extra pool; pools of {bench.POOL} tokens, page block "
                    f"{bench.PAGE}. Ceilings of the figure: {bench.CEILINGS_GPU} bf16 MMA {bench.BF16_MMA_TFLOPS:.0f} "
                    f"TFLOP/s, copy {bench.COPY_TBPS} TB/s (docs/performance.md)."),
        epilog="examples:\n"
               "  cute-mla bench --shape 1x8192x128 --vs flashmla --plot bench.png\n"
               "  cute-mla bench --shape 1x1x64 --shape 1x1024x64 --variant prefetch_rows=false\n"
               "  cute-mla bench --format V4 --shape 128x1x128 --vs flashmla --json v4.json\n"
               "  cute-mla bench --replot bench.json --plot bench.png      # any machine, no GPU")
    op_arg(sp)
    sp.add_argument("--shape", action="append", default=[], metavar="BxS_QxH_Q",
                    help="b x s_q x h_q, e.g. 1x8192x128 (repeat for a sweep)")
    sp.add_argument("--format", default="V3.2", help=f"the cache format: {formats} (default V3.2)")
    sp.add_argument("--extra-topk", type=int, default=None,
                    help=f"V4: the extra pool's list length, a multiple of 64 or 0 (default {bench.V4_EXTRA_TOPK})")
    sp.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="a kernel variant (its Tuning fields; repeat for several): " + bench.variant_keys_help())
    sp.add_argument("--vs", choices=("flashmla",), default=None, help="also time FlashMLA (vLLM's build) when importable")
    sp.add_argument("--plot", metavar="OUT.png", help="TFLOP/s per shape against the ceilings (needs matplotlib; "
                    "without it the results go to OUT.json, for --replot)")
    sp.add_argument("--json", metavar="OUT.json", help="write the results")
    sp.add_argument("--replot", metavar="RESULTS.json", help="plot saved results (with --plot; no GPU needed)")
    sp.add_argument("--sample", type=positive_int, default=bench.SAMPLE_TOKENS,
                    help=f"query tokens per shape checked against the reference (default {bench.SAMPLE_TOKENS})")
    sp.add_argument("--warmup-s", type=float, default=bench.WARMUP_S,
                    help=f"seconds of bf16 matmuls first, so the clocks are up (default {bench.WARMUP_S:g})")
    sp.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, NotImplementedError, TypeError) as e:
        print(f"cute-mla {args.cmd}: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # e.g. an --out directory that cannot be created or written
        print(f"cute-mla {args.cmd}: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
