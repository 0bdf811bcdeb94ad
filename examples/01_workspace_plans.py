"""The split-KV workspace of vLLM's calls: cute-mla's plan against what FlashMLA allocates.

FlashMLA allocates (b + num_sm_parts) x s_q x h_q rows of fp32 accumulators on every SM90 call,
whether anything is split or not; cute-mla's plan (``cute_mla.plan_sparse_decode``, the same
object the call runs) allocates only the rows of the pieces it splits. This script plans the
shapes vLLM sends and prints both numbers side by side:

* decode batches: b = 1..512 requests of s_q = 1 or 2 tokens (2: one MTP draft), 64 or 128 heads;
* mixed batches: vLLM's high-TP layout, every token of the step as one request (b = 1,
  s_q = tokens, up to 32768), where FlashMLA's never-read buffers reach gigabytes;
* DeepSeek V3.2 (d_qk 576, top-k 2048, no lengths) and V4 (d_qk 512, top-k 128 with
  ``topk_length``, plus an extra list of 512 or 1024 with ``extra_topk_length``).

It checks that no plan needs more than FlashMLA's buffers and draws the workspace in MiB against
the tokens of a call (PNG, needs matplotlib: ``pip install -e ".[plot]"``). Planning needs no GPU
and no compile; it takes about two seconds.

    python examples/01_workspace_plans.py                      # sm_90a (H100 / H200); the PNG in a new temp dir
    python examples/01_workspace_plans.py --arch sm_100a --out /tmp/ws.png

``cute-mla plan --b 1 --s-q 8192 --h-q 64`` prints one of these plans in full.

Needs: CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from cute_mla import archs, plan_sparse_decode
from cute_mla.formats import V4, V32

# vLLM pads the heads of a rank to the kernel's 64 or 128.
HEADS = (64, 128)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_S_Q = (1, 2)
MIXED_TOKENS = tuple(2**i for i in range(16))            # 1 .. 32768 tokens of one step
V32_TOPK = 2048
V4_TOPK, V4_EXTRA = 128, (0, 512, 1024)
MIB = 2**20


def plan(arch: str, b: int, s_q: int, h_q: int, fmt: str, extra: int = 0):
    """The plan of one call as vLLM makes it: V3.2 without lengths, V4 with both lists' lengths."""
    spec = archs.get(arch)
    if fmt == "v32":
        return plan_sparse_decode(b, s_q, h_q, V32.d_qk, V32_TOPK, arch=arch, num_sms=spec.default_num_sms)
    return plan_sparse_decode(b, s_q, h_q, V4.d_qk, V4_TOPK, arch=arch, num_sms=spec.default_num_sms,
                              has_topk_length=True, extra_topk=extra, has_extra_topk_length=extra > 0)


def cell(p) -> str:
    """cute-mla MiB / FlashMLA MiB (cute-mla's 0 is the no-split kernel: no accumulators, no combine)."""
    return f"{p.workspace_bytes / MIB:.2f} / {p.flashmla_workspace_bytes / MIB:.1f}"


def table(title: str, head: list, rows: list) -> None:
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  " + "  ".join(str(v).rjust(w) for v, w in zip(r, widths)))


def decode_batches(arch: str) -> list:
    cols = [(s_q, h) for s_q in DECODE_S_Q for h in HEADS]
    rows = [[b] + [cell(plan(arch, b, s_q, h, "v32")) for s_q, h in cols] for b in BATCHES]
    table(f"Decode batches, V3.2 (d_qk {V32.d_qk}, top-k {V32_TOPK}): cute-mla MiB / FlashMLA MiB",
          ["b"] + [f"s_q={s_q} h_q={h}" for s_q, h in cols], rows)
    return [plan(arch, b, s_q, h, "v32") for b in BATCHES for s_q, h in cols]


def mixed_batches(arch: str) -> list:
    rows = []
    for t in MIXED_TOKENS:
        row = [t]
        for h in HEADS:
            p = plan(arch, 1, t, h, "v32")
            how = "token walk" if p.token_walk else f"{p.accum_rows} split rows" if p.split else "one partition"
            row += [cell(p), how]
        rows.append(row)
    table("Mixed batches, V3.2 (b=1, s_q=tokens): cute-mla MiB / FlashMLA MiB, and how the plan runs it",
          ["tokens"] + [c for h in HEADS for c in (f"h_q={h}", "plan")], rows)
    return [plan(arch, 1, t, h, "v32") for t in MIXED_TOKENS for h in HEADS]


def v4_batches(arch: str) -> list:
    cols = [(e, h) for e in V4_EXTRA for h in HEADS]
    rows = [[b] + [cell(plan(arch, b, 1, h, "v4", e)) for e, h in cols] for b in BATCHES]
    table(f"V4 decode (d_qk {V4.d_qk}, top-k {V4_TOPK} + extra list, lengths on the device, s_q=1): "
          "cute-mla MiB / FlashMLA MiB",
          ["b"] + [f"extra={e} h_q={h}" for e, h in cols], rows)
    return [plan(arch, b, 1, h, "v4", e) for b in BATCHES for e, h in cols]


def draw(arch: str, path: str | None) -> None:
    """Workspace MiB against the call's tokens (b x s_q): FlashMLA dashed, cute-mla solid."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nno plot: matplotlib is not installed (pip install matplotlib); the tables above are its data")
        return
    # (title, tokens on the x axis, the plan of x tokens at h_q heads)
    panels = [
        ("V3.2 mixed batch (b=1, s_q=tokens)", MIXED_TOKENS, lambda t, h: plan(arch, 1, t, h, "v32")),
        ("V3.2 decode batch (s_q=2, tokens=2b)", [2 * b for b in BATCHES], lambda t, h: plan(arch, t // 2, 2, h, "v32")),
        (f"V4 decode, extra {V4_EXTRA[1]} (s_q=1, tokens=b)", BATCHES, lambda t, h: plan(arch, t, 1, h, "v4", V4_EXTRA[1])),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (title, xs, make) in zip(axes, panels):
        for h, color in zip(HEADS, ("tab:blue", "tab:orange")):
            plans = [make(t, h) for t in xs]
            ax.plot(xs, [p.flashmla_workspace_bytes / MIB for p in plans], "--o", color=color, ms=3,
                    label=f"FlashMLA h_q={h}")
            ax.plot(xs, [p.workspace_bytes / MIB for p in plans], "-s", color=color, ms=3, label=f"cute-mla h_q={h}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1)   # 0 MiB (no accumulators) stays on the plot
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens in the call (b x s_q)")
        ax.set_ylabel("split-KV workspace, MiB")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Split-KV workspace per call, {archs.get(arch).family} ({arch}, "
                 f"{archs.get(arch).default_num_sms} SMs)")
    fig.tight_layout()
    if path is None:   # the default: a new directory under the system's temp dir, not the current one
        path = os.path.join(tempfile.mkdtemp(prefix="cute-mla-workspace-"), "workspace.png")
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        sys.exit(f"01_workspace_plans.py: cannot write --out {path}: {e.strerror or e}")
    print(f"\nplot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=archs.SM90.name, choices=archs.SUPPORTED_ARCHS)
    ap.add_argument("--out", default=None,
                    help="the PNG to write (default: workspace.png in a new directory under the system's temp dir)")
    args = ap.parse_args(argv)

    spec = archs.get(args.arch)
    print(f"Split-KV workspace (o_accum + lse_accum) per call on {spec.family} ({args.arch}, "
          f"{spec.default_num_sms} SMs). FlashMLA's is the plan's formula "
          "(SparseDecodePlan.flashmla_workspace_bytes); out and lse are not counted.\n"
          "cute-mla 0.00: the plan splits nothing and runs the no-split kernel (no accumulators, no combine).")
    plans = decode_batches(args.arch) + mixed_batches(args.arch) + v4_batches(args.arch)

    worst = max(plans, key=lambda p: p.flashmla_workspace_bytes)
    print(f"\nlargest FlashMLA workspace: {worst.flashmla_workspace_bytes / MIB:.0f} MiB at "
          f"b={worst.b} s_q={worst.s_q} h_q={worst.h_q} (cute-mla: {worst.workspace_bytes / MIB:.0f} MiB)")
    over = [p for p in plans if p.workspace_bytes > p.flashmla_workspace_bytes]
    if over:
        p = over[0]
        sys.exit(f"{len(over)} plans need more workspace than FlashMLA's, e.g. b={p.b} s_q={p.s_q} h_q={p.h_q} "
                 f"d_qk={p.d_qk}: {p.workspace_bytes} > {p.flashmla_workspace_bytes} bytes")
    print(f"every one of the {len(plans)} plans needs at most FlashMLA's workspace; "
          f"{sum(p.workspace_bytes == 0 for p in plans)} need none")
    draw(args.arch, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
