"""The roofline figure of the committed H200 results: cute-mla and FlashMLA per shape, TFLOP/s
against arithmetic intensity (FLOP per byte), log-log, under the bf16 MMA and copy ceilings
measured on the H200 (``cute_mla.playground.bench``: the ceilings and the work of a row, as
docs/performance.md section 2 counts it).

A shape's intensity is its format's and head count's (and, for V4, its lists' lengths'): every
query token brings its own rows, so the V3.2 rows of one h_q share one intensity whatever b and
s_q. The points of one intensity are spread sideways (a few per cent) so that each shape's pair
stays legible; a thin line joins a shape's cute-mla point to its FlashMLA point.

    python -m benchmarks.roofline [--results A.json B.json ...] [--out docs/roofline.png]

It also prints each shape's intensity, roof and both libraries' share of it.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections import defaultdict

from cute_mla.playground.bench import (BF16_MMA_TFLOPS, CEILINGS_GPU, COPY_TBPS, LIBRARIES, load, roof_tflops,
                                       row_format, row_label, row_work)

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = [HERE / "results" / "h200-a666f26.json", HERE / "results" / "h200-3f48b74-v4.json"]
OUT = HERE.parent / "docs" / "roofline.png"
LIBS = ("cute", "flashmla")
MARKERS = {"V3.2": "o", "V4": "s"}
SPREAD = 1.02         # sideways factor between neighbouring points of one intensity
LABEL_GAP = 1.16      # least height factor between two labels of a column
X_TICKS = (20, 50, 100, 200, 500, 1000)
LABEL_DX = 1.08       # sideways factor from a point to its label
TITLES = {"V3.2": "V3.2 cache: top-k 2048, 20 % of the indices -1",
          "V4": "V4 cache: top-k 128 + an extra list, lengths uniform in [1, k], sinks"}


def points(paths):
    """[dict(row, format, column, intensity, tflops {library key: TFLOP/s}, source)] of every row with a time."""
    out = []
    for path in paths:
        meta, rows = load(str(path))
        for r in rows:
            flop, nbytes = row_work(r, meta)
            tflops = {k: flop / r[f"{k}_us"] * 1e-6 for k in LIBS if f"{k}_us" in r}
            if tflops:
                fmt = row_format(r)
                column = f"h={r['h_q']}" + (f"\nextra {r['extra_topk']}" if fmt == "V4" else "")
                out.append(dict(row=r, format=fmt, column=column, intensity=flop / nbytes, tflops=tflops,
                                 source=pathlib.Path(path).name))
    return out


def report(pts):
    print(f"{'shape':>16} {'format':>6} {'FLOP/B':>7} {'roof':>6} | "
          + " | ".join(f"{LIBRARIES[k]:>8} TF/s  of roof" for k in LIBS))
    for p in pts:
        roof, tf = roof_tflops(p["intensity"]), p["tflops"]
        cells = [f"{tf[k]:>13.1f} {tf[k] / roof:>7.1%}" if k in tf else f"{'-':>13} {'-':>7}" for k in LIBS]
        print(f"{row_label(p['row'], None):>16} {p['format']:>6} {p['intensity']:>7.1f} {roof:>6.0f} | " + " | ".join(cells))


def spread_labels(ys, factor):
    """Label heights for points at ``ys`` (log axis), at least ``factor`` apart: labels that would
    overlap form a group, spaced by ``factor`` around the group's geometric mean height."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    groups = []                            # [indices], bottom up
    for i in order:
        groups.append([i])
        while len(groups) > 1:             # merge with the group below while they overlap
            lower, upper = groups[-2], groups[-1]
            if placed(ys, lower, factor)[-1] * factor <= placed(ys, upper, factor)[0]:
                break
            groups[-2:] = [lower + upper]
    out = [0.0] * len(ys)
    for g in groups:
        for i, y in zip(g, placed(ys, g, factor)):
            out[i] = y
    return out


def placed(ys, group, factor):
    """Heights of a group's labels: ``factor`` apart, centred (log) on its points."""
    mid = sum(math.log(ys[i]) for i in group) / len(group)
    return [math.exp(mid + (k - (len(group) - 1) / 2) * math.log(factor)) for k in range(len(group))]


def draw(pts, out, sources):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    formats = [f for f in MARKERS if any(p["format"] == f for p in pts)]
    fig, axes = plt.subplots(1, len(formats), figsize=(6.5 * len(formats), 6.5), sharey=True, squeeze=False)
    lo, hi, bottom, top = 20.0, 1000.0, 0.1, 1500.0
    ridge = BF16_MMA_TFLOPS / COPY_TBPS
    colors = {"cute": "tab:blue", "flashmla": "tab:orange"}
    for ax, fmt in zip(axes[0], formats):
        xs = [lo, ridge, hi]
        ax.plot(xs, [roof_tflops(x) for x in xs], color="k", linewidth=1.5)
        ax.text(lo * 1.15, roof_tflops(lo * 1.15) * 1.2, f"copy {COPY_TBPS} TB/s", rotation=31, fontsize=8)
        ax.text(hi / 1.05, BF16_MMA_TFLOPS * 1.08, f"bf16 MMA {BF16_MMA_TFLOPS:.0f} TFLOP/s", ha="right", fontsize=8)
        ax.axvline(ridge, color="grey", linewidth=0.5, linestyle=":")
        ax.text(ridge * 1.03, 1.5, f"ridge {ridge:.0f} FLOP/B", fontsize=7, color="grey")
        columns = defaultdict(list)
        for p in pts:
            if p["format"] == fmt:
                columns[p["column"]].append(p)
        cols = sorted(columns.values(), key=lambda c: c[0]["intensity"])
        at = [c[0]["intensity"] for c in cols]
        for n, col in enumerate(cols):
            col.sort(key=lambda p: p["tflops"].get("cute", 0.0))
            # labels on the side of the wider gap to the next column (the first left, the last right)
            gap_left = at[n] / at[n - 1] if n else math.inf
            gap_right = at[n + 1] / at[n] if n + 1 < len(at) else math.inf
            right = gap_right > gap_left
            ys = [p["tflops"].get("cute", min(p["tflops"].values())) for p in col]
            for p, x, y, ly in zip(col, (col[0]["intensity"] * SPREAD ** (i - (len(col) - 1) / 2) for i in range(len(col))),
                                   ys, spread_labels(ys, LABEL_GAP)):
                tf = p["tflops"]
                if len(tf) == 2:
                    ax.plot([x, x], [tf["cute"], tf["flashmla"]], color="grey", linewidth=0.6, zorder=1)
                for k, v in tf.items():
                    ax.scatter([x], [v], marker=MARKERS[fmt], s=20, zorder=2, color=colors[k] if k == "cute" else "white",
                               edgecolors=colors[k], linewidths=1.0)
                r = p["row"]
                ax.annotate(f"{r['b']}x{r['s_q']}", (x, y), xytext=(x * (LABEL_DX if right else 1 / LABEL_DX), ly),
                            ha="left" if right else "right", va="center", fontsize=6, color="0.25",
                            arrowprops=dict(arrowstyle="-", color="0.7", linewidth=0.4, shrinkA=0, shrinkB=2))
            ax.text(col[0]["intensity"], bottom * 1.1, col[0]["column"].replace("\n", ", "), rotation=90,
                    ha="center", va="bottom", fontsize=7)
        for k in LIBS:
            ax.scatter([], [], marker=MARKERS[fmt], s=20, color=colors[k] if k == "cute" else "white",
                       edgecolors=colors[k], label=LIBRARIES[k])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xticks(X_TICKS, [str(t) for t in X_TICKS])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(bottom, top)
        ax.set_title(TITLES.get(fmt, fmt), fontsize=9)
        ax.set_xlabel("FLOP per byte (cache rows, indices, q, out, lse)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    axes[0][0].set_ylabel("TFLOP/s")
    fig.suptitle(f"Sparse MLA decode on the {CEILINGS_GPU}: cute-mla and FlashMLA under the measured ceilings "
                 "(CUDA graph replay of one call; points labelled b x s_q, columns h_q and the extra list)", fontsize=10)
    fig.text(0.01, 0.005, "data: " + ", ".join(f"benchmarks/results/{s}" for s in sources) + "; regenerate: "
             "python -m benchmarks.roofline", fontsize=6, color="grey")
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", nargs="+", default=[str(p) for p in RESULTS],
                    help="results JSONs (bench_sparse_decode --json, bench_sparse_decode --v4 --out, cute-mla bench --json)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    pts = points(args.results)
    if not pts:
        raise SystemExit("roofline: no timed rows in " + ", ".join(args.results))
    report(pts)
    draw(pts, args.out, sorted({p['source'] for p in pts}))
    print(f"figure: {args.out} ({len(pts)} shapes)")


if __name__ == "__main__":
    main()
