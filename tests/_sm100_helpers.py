"""What the SM100 kernels' tests share (the decode and the prefill kernel have one MMA side, one TMEM
teardown and one way to hang): the control-flow graph of a kernel's PTX and the checks made on it,
and the GPU tests' hang watchdog. Plain Python: no DSL import (the GPU tests import it too)."""

from __future__ import annotations

import os
import re
import time

import pytest

WAIT = "mbarrier.try_wait"
_LABEL = re.compile(r"^(\$L__\w+):")
# Branches between the kernel's own blocks; the mbarrier spin loops are inline asm with local labels
# (LAB_WAIT / DONE), which stay inside their block.
_BRA = re.compile(r"^(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__\w+);")


def instructions(ptx: str) -> list:
    return [ln.strip() for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith("//")]


def ptx_cfg(ptx: str):
    """(blocks, successors) of the kernel body: a block is a list of instruction lines."""
    blocks, labels = [[]], {}
    for raw in ptx[ptx.index(".entry"):].splitlines():
        line = raw.strip()
        m = _LABEL.match(line)
        if m:
            if blocks[-1]:
                blocks.append([])
            labels[m.group(1)] = len(blocks) - 1
            continue
        if not line or line.startswith("//"):
            continue
        blocks[-1].append(line)
        if _BRA.match(line) or line.startswith(("ret;", "exit;", "trap;")):
            blocks.append([])
    succ = []
    for i, b in enumerate(blocks):
        last = b[-1] if b else ""
        m = _BRA.match(last)
        if m:
            succ.append([labels[m.group(2)]] + ([i + 1] if m.group(1) else []))
        elif last.startswith(("ret;", "exit;", "trap;")) or i + 1 == len(blocks):
            succ.append([])
        else:
            succ.append([i + 1])
    return blocks, succ


def _sccs(nodes, succ):
    """Strongly connected components (Tarjan, iterative) of the subgraph on ``nodes``."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter([s for s in succ[root] if s in nodes]))]
        index[root] = low[root] = n[0]
        n[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    out.append(comp)
            elif w not in index:
                index[w] = low[w] = n[0]
                n[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter([s for s in succ[w] if s in nodes])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def cycles(succ, nodes):
    """The components of ``nodes`` that hold a cycle."""
    return [c for c in _sccs(nodes, succ) if len(c) > 1 or any(v in succ[v] for v in c)]


def has(block, pattern) -> bool:
    return any((pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line) for line in block)


def waits_outside_loops(ptx: str) -> int:
    """mbarrier waits in blocks outside every cycle of the control-flow graph: the once-per-CTA waits
    and the producer tails."""
    blocks, succ = ptx_cfg(ptx)
    in_loops = set().union(*cycles(succ, set(range(len(blocks)))))
    return sum(line.count(WAIT) for v, b in enumerate(blocks) if v not in in_loops for line in b)


def check_tmem_teardown(ptx: str, bar_id: int, threads: int) -> None:
    """The MMA warp deallocates TMEM after barrier ``bar_id`` (``threads``: the softmax warpgroup
    and the MMA warp) with tcgen05.fence::after_thread_sync as the only tcgen05 instruction between
    them; the softmax warpgroup arrives there right after tcgen05.fence::before_thread_sync, and no
    tcgen05 instruction follows its arrival."""
    ins = instructions(ptx)
    tmem_bar = f"bar.sync \t{int(bar_id)}, {threads};"
    bars = [i for i, s in enumerate(ins) if s == tmem_bar]
    dealloc = [i for i, s in enumerate(ins) if s.startswith("tcgen05.dealloc")]
    assert len(dealloc) == 1
    before = max(i for i in bars if i < dealloc[0])
    assert [s for s in ins[before:dealloc[0]] if s.startswith("tcgen05.")] == ["tcgen05.fence::after_thread_sync;"]
    fenced = [i for i in bars if ins[i - 1] == "tcgen05.fence::before_thread_sync;"]
    assert len(fenced) == 1 and fenced[0] > dealloc[0]
    assert not [s for s in ins[fenced[0]:] if s.startswith("tcgen05.")], "TMEM used after the teardown barrier"


def finish_or_exit(what: str, kernel: str = "SM100 kernel", see: str = "first run on a B200") -> None:
    """Wait for the GPU work queued so far; if it has not finished after 60 s (SM100_HANG_TIMEOUT_S:
    more under compute-sanitizer), stop the test session (pytest.exit): a hung kernel keeps the
    GPU, every later test would hang too. ``kernel`` and ``see`` (a docs/sm100.md section) name
    the kernel and where to look in the message."""
    import torch

    timeout_s = float(os.environ.get("SM100_HANG_TIMEOUT_S", "60"))
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            pytest.exit(f"{what}: the {kernel} did not finish in {timeout_s:.0f} s (a hang; docs/sm100.md, {see})",
                        returncode=3)
        time.sleep(0.005)
