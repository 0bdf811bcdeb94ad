"""CPU: the op registry (``cute_mla.registry``). Every registered (op, arch) keeps the kernel protocol
and compiles; its plans' configs come from ``config_for``; the tensor bundle's field lists agree
with each compiled entry, the fake arguments and the custom op's schema.

The compile tests iterate the registry (``registry.entries()``), not a hand-written list: a new
(op, arch) line is compiled here the day it is added.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from cute_mla import archs, registry
from cute_mla.kernels import SPARSE_DECODE_INPUTS, SPARSE_PREFILL_INPUTS, SparseDecodeTensors, SparsePrefillTensors
from cute_mla.plan.policy import default_policy

ENTRIES = sorted(registry.entries())
MAIN_PROTOCOL = ("Config", "Tuning", "Kernel", "ENTRY", "kernel_config", "config_for", "compile", "launch",
                 "tensor_maps")
HELPER_PROTOCOL = ("Config", "compile", "launch")


def _plans(op: str, arch: str):
    """A spread of plans the op makes on ``arch`` (every schedule kind its policy reaches)."""
    plan = registry.plan_function(op)
    if op == "sparse_prefill":
        for s_q, h_q, d_qk, tl in itertools.product((1, 4096), (8, 16, 32, 64, 128), (576, 512), (False, True)):
            yield plan(s_q, h_q, d_qk, 2048, arch=arch, has_topk_length=tl)
        return
    num_sms = archs.get(arch).default_num_sms
    for (b, s_q), h_q, (d_qk, topk, extra), tl in itertools.product(
            [(1, 1), (1, 8), (1, 8192), (128, 1), (512, 1)], (64, 128),
            [(576, 2048, 0), (512, 128, 512), (512, 128, 1024)], (False, True)):
        yield plan(b, s_q, h_q, d_qk, topk, arch=arch, num_sms=num_sms, has_topk_length=tl, extra_topk=extra,
                   has_extra_topk_length=tl and bool(extra))


def test_the_registry_lists_every_arch_of_every_op():
    """Every op has a kernel on every arch, but for the pairs the registry names as pending (each
    with its reason, which the refusal and ``cute-mla ops`` show)."""
    assert ENTRIES == sorted((op, a) for op in registry.OPS for a in archs.SUPPORTED_ARCHS
                             if (op, a) not in registry.PENDING)
    for (op, arch), why in registry.PENDING.items():
        assert op in registry.OPS and arch in archs.SUPPORTED_ARCHS and why
        with pytest.raises(ValueError, match=why):
            registry.kernel_module(op, arch)
    assert registry.DEFAULT_OP in registry.OPS
    for name in ("sparse_decode", "sm90_sparse_decode", "sm100_sparse_decode", "combine", "scheduler"):
        assert name in registry.describe()


@pytest.mark.parametrize("op, arch", ENTRIES)
def test_kernel_modules_keep_the_protocol(op, arch):
    mod = registry.kernel_module(op, arch)
    missing = [n for n in MAIN_PROTOCOL if not hasattr(mod, n)]
    assert not missing, f"{mod.__name__} lacks {missing}"
    for helper in registry.op(op).helpers:
        hmod = registry.kernel_module(op, arch, helper)
        assert not [n for n in HELPER_PROTOCOL if not hasattr(hmod, n)], hmod.__name__
    if "combine" in registry.op(op).helpers:     # a split-KV op: what its split variant writes
        assert hasattr(mod, "ACCUM_DTYPE")
    if op == "sparse_prefill":                   # the scales a config is exact at, and its form for all
        assert callable(mod.Config.takes_scale) and callable(mod.Config.any_scale)
        assert callable(mod.bind)                # a launch bound to a call signature


@pytest.mark.parametrize("op, arch", ENTRIES)
def test_the_host_entry_takes_the_bundle_fields_in_entry_order(op, arch):
    """``ENTRY`` is written once per kernel: the host entry's parameters are it (after a grid that a
    bound launch fixes ahead of the tensors, ``ctas``, where the kernel takes one; then the kernel's
    own: instrumentation, the scale, the stream), and every name is a bundle field."""
    mod = registry.kernel_module(op, arch)
    params = list(inspect.signature(mod.Kernel.__call__).parameters)[1:]
    start = params.index(mod.ENTRY[0])
    assert params[:start] in ([], ["ctas"])
    assert tuple(params[start:start + len(mod.ENTRY)]) == mod.ENTRY
    assert set(mod.ENTRY) <= set(registry.bundle_type(op)._fields)
    assert params[-2:] == ["softmax_scale", "stream"]


@pytest.mark.parametrize("op, arch", ENTRIES)
def test_plans_map_to_configs(op, arch):
    """``config_for`` of the op's plans: the plan's choices and nothing else; the plan's tensor maps
    are the kernel's (``tensor_maps``)."""
    mod = registry.kernel_module(op, arch)
    for plan in _plans(op, arch):
        cfg = mod.config_for(plan, has_attn_sink=True)
        assert isinstance(cfg, mod.Config)
        if op == "sparse_prefill":
            assert (cfg.h_q, cfg.d_qk, cfg.has_topk_length) == (plan.kernel_h_q, plan.d_qk, plan.has_topk_length)
            assert plan.tensor_maps == mod.tensor_maps(cfg)
            continue
        assert (cfg.h_q, cfg.split, cfg.has_topk_length, cfg.format) == (plan.h_q, plan.split, plan.has_topk_length,
                                                                          plan.format)
        assert plan.tensor_maps == mod.tensor_maps(cfg)
        if plan.split:
            assert plan.accum_dtype == mod.ACCUM_DTYPE == registry.config_module(op, arch).ACCUM_DTYPE


def test_a_plan_whose_accum_dtype_the_kernel_does_not_write_is_refused():
    import dataclasses

    plan = registry.plan_function("sparse_decode")(1, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert plan.split
    mod = registry.kernel_module("sparse_decode", "sm_90a")
    with pytest.raises(ValueError, match="accum_dtype"):
        mod.config_for(dataclasses.replace(plan, accum_dtype="float32"), has_attn_sink=False)


def compile_every_kernel(op: str, arch: str, out_dir):
    """Compile one config of each kernel an (op, arch) can run (the first its variants list has)
    into ``out_dir``; returns the kernels compiled. Raises whatever a compile raises."""
    from cute_mla.playground import inspect as ki

    seen = set()
    for kernel, cfg in registry.variants(op, arch):
        if kernel in seen:
            continue
        seen.add(kernel)
        d = out_dir / kernel
        registry.kernel_module(op, arch, kernel).compile(cfg, dump_dir=str(d))
        ptx, _ = ki.find_artifacts(str(d), arch)
        assert ptx is not None, (op, arch, kernel)
    return seen


@pytest.mark.parametrize("op, arch", ENTRIES)
def test_every_registered_kernel_compiles(op, arch, tmp_path):
    """Each kernel of each registered (op, arch) compiles on this CPU machine and leaves PTX."""
    assert compile_every_kernel(op, arch, tmp_path) == set(registry.op(op).kernel_names())


def test_a_registered_kernel_that_does_not_compile_fails(tmp_path, monkeypatch):
    """The compile check sees a registered (op, arch) whose kernel does not compile."""
    import sys
    import types

    broken = types.ModuleType("broken_kernel")

    def compile(cfg, dump_dir=None):
        raise RuntimeError("the DSL refused it")

    broken.compile = compile
    broken.variants = lambda arch, **kw: [("broken", object())]
    monkeypatch.setitem(sys.modules, "broken_kernel", broken)
    ref = registry.KernelRef("broken", "broken_kernel")
    spec = registry.OpSpec(name="broken", summary="", api=(), bundle="", plan="broken_kernel:compile",
                           variants="broken_kernel:variants", kernels={"sm_90a": ref}, helpers={})
    monkeypatch.setitem(registry.OPS, "broken", spec)
    with pytest.raises(RuntimeError, match="refused"):
        compile_every_kernel("broken", "sm_90a", tmp_path)


def test_the_custom_op_schema_is_the_bundle_inputs():
    """The ``cute_mla::sparse_decode`` op's tensor parameters are the bundle's input fields, in order,
    optional exactly where the bundle's are."""
    import cute_mla.interface.ops  # noqa: F401  (defines the ops)

    args = torch.ops.cute_mla.sparse_decode.default._schema.arguments
    names = tuple(a.name for a in args[:len(SPARSE_DECODE_INPUTS)])
    assert names == SPARSE_DECODE_INPUTS == SparseDecodeTensors._fields[:len(SPARSE_DECODE_INPUTS)]
    optional = {a.name for a in args[:len(SPARSE_DECODE_INPUTS)] if "Optional" in str(a.type)}
    assert optional == {n for n in SPARSE_DECODE_INPUTS if SparseDecodeTensors._field_defaults.get(n, 0) is None}


def test_the_prefill_op_schema_is_the_bundle_inputs():
    """``cute_mla::sparse_prefill``'s tensor parameters are its bundle's input fields, in order."""
    import cute_mla.interface.prefill  # noqa: F401  (defines the op)

    args = torch.ops.cute_mla.sparse_prefill.default._schema.arguments
    names = tuple(a.name for a in args[:len(SPARSE_PREFILL_INPUTS)])
    assert names == SPARSE_PREFILL_INPUTS == SparsePrefillTensors._fields[:len(SPARSE_PREFILL_INPUTS)]
    optional = {a.name for a in args[:len(SPARSE_PREFILL_INPUTS)] if "Optional" in str(a.type)}
    assert optional == {n for n in SPARSE_PREFILL_INPUTS if SparsePrefillTensors._field_defaults.get(n, 0) is None}


def test_unknown_op_and_kernel_names_are_refused():
    with pytest.raises(ValueError, match="op: got 'dense_decode', accepted: sparse_decode, sparse_prefill"):
        registry.op("dense_decode")
    with pytest.raises(ValueError, match="kernel: got 'nope'"):
        registry.kernel_module("sparse_decode", "sm_90a", "nope")
    with pytest.raises(ValueError, match="arch"):
        registry.kernel_module("sparse_decode", "sm_80")


def test_policies_are_values_a_plan_takes():
    """Another policy changes the plan, and nothing in the library changes with it."""
    import dataclasses

    plan = registry.plan_function("sparse_decode")
    base = default_policy("sm_90a")
    args = (512, 1, 128, 512, 128)
    kw = dict(arch="sm_90a", num_sms=132, has_topk_length=True, extra_topk=1024, has_extra_topk_length=True)
    assert plan(*args, **kw).schedule == "balanced"
    assert plan(*args, **kw, policy=dataclasses.replace(base, packed=None)).schedule == "device"
    assert plan(*args, **kw).schedule == "balanced" and default_policy("sm_90a") is base
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.packed = None


def test_plans_do_not_load_the_dsl():
    """A plan, its description and its tensor maps read the config modules only: ``cute-mla plan``
    works without loading the CuTe DSL."""
    import subprocess
    import sys

    code = ("import sys, cute_mla\n"
            "for arch in ('sm_90a', 'sm_100a'):\n"
            "    p = cute_mla.plan_sparse_decode(2, 1, 64, 512, 128, arch=arch, num_sms=132, extra_topk=512)\n"
            "    p.describe(); p.tensor_maps\n"
            "from cute_mla import warmup\n"
            "warmup.variants('sm_100a', kinds=('sparse_decode',))\n"
            "loaded = [m for m in sys.modules if m == 'cutlass' or m.startswith('cutlass.')]\n"
            "assert not loaded, loaded[:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", [arch for op, arch in ENTRIES if op == "sparse_prefill"])
def test_a_bound_prefill_launch_hands_the_entry_its_arguments_in_order(arch):
    """The kernel module's ``bind`` (one per call signature) calls the compiled entry with the
    entry's tensors, the scale and, where the host entry takes one, the grid fixed by the binding:
    each in the place the host entry's signature gives it (a stand-in entry records what it got)."""
    mod = registry.kernel_module("sparse_prefill", arch)
    s_q, num_sms = 4096, 132
    cfg = mod.config_for(registry.plan_function("sparse_prefill")(s_q, 64, 512, 512, arch=arch, s_kv=8192), True)
    got = []

    class Compiled:
        fn = staticmethod(lambda *args: got.append(args))

    tensors = [torch.zeros(8192, 1, 512) if name == "kv" else object() for name in mod.ENTRY]
    mod.bind(Compiled, cfg, s_q, num_sms)(*tensors, 0.25)
    params = list(inspect.signature(mod.Kernel.__call__).parameters)[1:-1]    # not self, not the stream
    assert len(got) == 1 and len(got[0]) == len(params)
    passed = dict(zip(params, got[0]))
    assert all(passed[name] is t for name, t in zip(mod.ENTRY, tensors)) and passed["softmax_scale"] == 0.25
    if "ctas" in passed:
        assert passed["ctas"] == mod.grid_ctas(cfg, s_q, num_sms) > 0
