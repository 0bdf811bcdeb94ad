"""Compile the SM90 and SM100 sparse decode kernels on this machine and read what came out.

No GPU is needed: the CuTe DSL traces a kernel against fake tensors and ptxas assembles it for
the target, so a laptop can check what an H200 or a B200 would run. For each kernel this prints

1. its resources: registers per thread, shared memory (static, and the dynamic struct), TMEM on
   SM100, stack and local memory (any byte there is a spill);
2. its PTX instruction mix: wgmma (SM90) or tcgen05.mma (SM100), TMA, TMA gather4 (SM100),
   setmaxnreg (the per-role register split), the global loads;
3. the SASS check the compile tests make (tests/test_sm90_compile.py): ptxas serializes wgmma
   chains when registers run short (every HGMMA then waits on its own result, ~1.8x slower),
   shown on the production kernel and on the register budget docs/performance.md rejected;
4. where each role's code is in the PTX: a role starts at its warp group's ``setmaxnreg``, whose
   target is the role's register budget, and the PTX keeps the roles in that order.

The PTX and cubin files stay in ``--out`` for reading further (``cuobjdump -sass FILE.cubin``).
It takes about 15 s on a 2-core machine (four compiles; each one compiles afresh, the compile
cache does not apply when the PTX and cubin are kept) and needs the ``test`` extra's cuobjdump
wheel for items 1 and 3 (``pip install -e ".[test]"``); without it those lines say so.

    python examples/03_compile_and_read.py                   # files in a new directory under the temp dir
    python examples/03_compile_and_read.py --out /tmp/k

``cute-mla compile --arch sm_90a --kernel sparse_decode --out DIR`` compiles one of these alone.

Needs: CPU
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

from cute_mla import archs
from cute_mla.playground import inspect, registry

# (title, arch, compile_to_dir options): the kernels vLLM's calls run most.
KERNELS = (
    ("SM90, 64 heads, no split (decode batches, the mixed batch)", archs.SM90.name, dict(h_q=64)),
    ("SM90, 128 heads, split (a cluster of 2 sharing each K tile)", archs.SM90.name, dict(h_q=128, split=True)),
    ("SM100, 64 heads, no split", archs.SM100.name, dict(h_q=64)),
)
# PTX families counted inside each role's region (registry.INSTRUCTIONS counts them per kernel).
ROLE_COUNTS = (("wgmma", "wgmma.mma_async"), ("tcgen05.mma", "tcgen05.mma"), ("TMA", "cp.async.bulk.tensor"),
               ("gather4", "tile::gather4"), ("ld.global", "ld.global"), ("mbarrier waits", "mbarrier.try_wait"),
               ("bar.sync", "bar.sync"))
SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
CONTEXT = 3   # PTX lines shown either side of a marker


def role_names(arch: str) -> dict:
    """setmaxnreg target -> the role that sets it (each arch's register budget is the one place)."""
    if arch == archs.SM90.name:
        from cute_mla.kernels.sm90.config import Role, tile_registers
        regs = tile_registers(64)
        return {regs.softmax: f"{Role.SOFTMAX.name} (warp group {int(Role.SOFTMAX)}: softmax.py, epilogue.py)",
                regs.pv_right: f"{Role.PV_RIGHT.name} (warp group {int(Role.PV_RIGHT)}: pv.py, epilogue.py)",
                regs.producer: f"{Role.PRODUCER.name} (warp group {int(Role.PRODUCER)}: producer.py / crossover.py, "
                               "index_scan.py)"}
    from cute_mla.kernels.sm100.sparse_decode import REGS, Warp
    return {REGS.softmax: f"{Warp.SOFTMAX.name} (warps 0-3)", REGS.dequant: f"{Warp.DEQUANT.name} (warps 4-7)",
            REGS.producers: f"{Warp.MMA.name}, {Warp.GATHER.name}, {Warp.INDEX.name} (warps 8-11)"}


def show(lines: list, at: int, label: str) -> None:
    """PTX lines around ``at`` (0-based), numbered as in the file."""
    print(f"    {label}:")
    for i in range(max(0, at - CONTEXT), min(len(lines), at + CONTEXT + 1)):
        print(f"    {'>' if i == at else ' '} {i + 1:6d}  {lines[i].strip()[:110]}")


def roles(arch: str, ptx_path: str) -> None:
    """Each role's region of the PTX (its setmaxnreg to the next one's), what it holds, and the
    first lines of the first two roles."""
    with open(ptx_path) as f:
        lines = f.read().splitlines()
    names = role_names(arch)
    starts = [(i, int(m.group(2))) for i, ln in enumerate(lines) for m in [SETMAXNREG.search(ln)] if m]
    print(f"  roles in {os.path.basename(ptx_path)} ({len(lines)} lines):")
    for k, (i, regs) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(lines)
        text = "\n".join(lines[i:end])
        counts = ", ".join(f"{label} {text.count(tok)}" for label, tok in ROLE_COUNTS if tok in text)
        print(f"    lines {i + 1:5d}-{end:5d}  setmaxnreg {regs:3d}  {names.get(regs, '?')}")
        print(f"                       {counts}")
    i, regs = starts[0]
    show(lines, i, f"the start of {names.get(regs, '?').split(' (')[0]} (its setmaxnreg)")
    # Markers inside a role: SM90's first row gather load (the producer) and first wgmma (the
    # softmax warp group's first QK k-step); SM100's first tcgen05.mma (the MMA warp) and first
    # TMA gather4 (the GATHER warp).
    for token, what in markers(arch):
        at = next((i for i, ln in enumerate(lines) if token in ln), None)
        if at is not None:
            show(lines, at, what)


def markers(arch: str) -> tuple:
    """(PTX token, what its first occurrence is) of an arch's kernel."""
    if arch == archs.SM90.name:
        from cute_mla.kernels.sm90.config import tile_gather_l1
        return ((f"ld.global.L1::{tile_gather_l1(64)}", "the first row gather load (PRODUCER)"),
                ("wgmma.mma_async", "the first wgmma (SOFTMAX: a QK k-step)"))
    return (("tcgen05.mma", "the first tcgen05.mma (MMA warp)"), ("tile::gather4", "the first TMA gather4 (GATHER warp)"))


def sass_check(label: str, cubin: str):
    """The wgmma serialization and spill checks of tests/test_sm90_compile.py on one cubin:
    (serialized, spill instructions), or None without cuobjdump."""
    if inspect.find_tool("cuobjdump") is None:
        print(f"  {label}: no SASS (cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
        return None
    sass = inspect.sass(cubin)
    st = inspect.hgmma_stats(sass)
    verdict = ("SERIALIZED: every HGMMA waits for its own result" if st.serialized
               else "asynchronous: only each chain's last HGMMA waits")
    spills = inspect.local_memory_ops(sass)
    print(f"  {label}: {st.total} HGMMA, {st.with_gsb0} with the gsb0 wait, {st.depbar_gsb0} WARPGROUP.DEPBAR "
          f"-> {verdict}; {spills} spill loads/stores (LDL/STL)")
    return st.serialized, spills


def rejected_budget(out_dir: str) -> str:
    """The SM90 kernel compiled with the 192/160/152 register budget docs/performance.md rejected
    (section 6), through the variant seam (Sm90Tuning); returns its cubin."""
    from cute_mla.kernels.sm90 import RegisterBudget, Sm90Tuning
    from cute_mla.kernels.sm90 import sparse_decode as sm90

    budget = RegisterBudget(softmax=192, pv_right=160, producer=152)
    cfg = sm90.kernel_config(h_q=64, format="V3.2", split=False, has_topk_length=False, has_attn_sink=False,
                             tuning=Sm90Tuning(registers=budget))
    d = os.path.join(out_dir, "rejected-registers-192-160-152")
    os.makedirs(d, exist_ok=True)
    sm90.compile(cfg, dump_dir=d)
    _, cubin = inspect.find_artifacts(d, archs.SM90.name)
    return cubin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="where the PTX and cubin files go (default: a new directory under the system's temp dir)")
    args = ap.parse_args(argv)
    try:
        if args.out is None:
            args.out = tempfile.mkdtemp(prefix="cute-mla-kernels-")
        os.makedirs(args.out, exist_ok=True)
        print(f"PTX and cubin files go to {args.out}")
    except OSError as e:
        sys.exit(f"{os.path.basename(__file__)}: cannot create --out {args.out}: {e.strerror}")

    t_all = time.time()
    mixes, sm90_cubins = [], []
    for title, arch, opts in KERNELS:
        print(f"\n== {title}")
        t0 = time.time()
        report = registry.compile_to_dir("sparse_decode", arch, args.out, **opts)
        print(f"  compiled for {arch} in {time.time() - t0:.1f} s")
        for line in report:
            print(f"  {line}")
        ptx = next(ln.split(None, 1)[1] for ln in report if ln.startswith("ptx:"))
        cubin = next(ln.split(None, 1)[1] for ln in report if ln.startswith("cubin:"))
        with open(ptx) as f:
            text = f.read()
        mixes.append((title.split(",")[0] + f" h{opts['h_q']}", {label: text.count(tok) for label, tok in registry.INSTRUCTIONS}))
        if arch == archs.SM90.name:
            sm90_cubins.append((title.split(" (")[0], cubin))
        roles(arch, ptx)

    print("\n== PTX instruction mix")
    labels = [label for label, _ in registry.INSTRUCTIONS]
    print("  " + "kernel".ljust(12) + "".join(label.rjust(13) for label in labels))
    for name, counts in mixes:
        print("  " + name.ljust(12) + "".join(str(counts[label]).rjust(13) for label in labels))

    print("\n== SASS: are the wgmma chains asynchronous? (tests/test_sm90_compile.py checks every variant)")
    problems = []
    for label, cubin in sm90_cubins:
        if sass_check(label, cubin) not in (None, (False, 0)):
            problems.append(f"{label}: serialized wgmma or spills")
    t0 = time.time()
    cubin = rejected_budget(args.out)
    found = sass_check(f"SM90 with registers 192/160/152 (rejected; compiled in {time.time() - t0:.1f} s)", cubin)
    if found is not None and not found[0]:
        problems.append("the 192/160/152 budget no longer serializes: docs/performance.md's limits need a new look")
    if inspect.find_tool("cuobjdump") is not None:
        u = inspect.resource_usage(cubin)
        print(f"    its resources: registers {u.get('REG')}, stack {u.get('STACK')} B (the production budget: "
              "216/160/128, no stack)")
    print(f"\nfiles in {args.out}; all of it took {time.time() - t_all:.0f} s")
    if problems:
        sys.exit(f"{os.path.basename(__file__)}: {'; '.join(problems)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
