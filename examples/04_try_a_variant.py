"""Try a kernel variant: change one value of the SM90 kernel's config, check it, time it against the default.

A variant of the SM90 sparse decode kernel is a value of its frozen ``Sm90Tuning``
(``cute_mla/kernels/sm90/config.py``). This script turns off ``prefetch_rows``, the producer's L2
prefetch of the cache rows of tile T+2 while tile T is consumed (docs/performance.md measured it at
+4 to +6.5 % when it went in). The variant runs through the public call, unchanged: a metadata
object that carries the tuning makes every call with it compile and launch that kernel::

    sched = FlashMLASchedMeta(tuning=Sm90Tuning(prefetch_rows=False))   # instead of get_mla_metadata()

Then, in one run (``cute_mla.playground.bench``, the core of ``cute-mla bench``):

1. the default and the variant are each checked against the fp32 reference on a sample of query
   tokens, with FlashMLA's tolerances (a kernel that fails is not timed; exit status 1);
2. both are timed by CUDA graph replay, interleaved round by round;
3. a table: µs, TFLOP/s, the variant's speed-up over the default, transient memory.

    python examples/04_try_a_variant.py                      # vLLM's mixed batch of 1024 tokens, 64 heads
    python examples/04_try_a_variant.py --shape 128x2x128    # a decode batch
    cute-mla bench --shape 1x1024x64 --variant prefetch_rows=false   # the same from the command line

Any other field works the same way (``Sm90Tuning(h128_cluster=False)``, ``gather_l2=""``, a
``RegisterBudget``); ``cute-mla bench --help`` lists them with their defaults.

Needs: GPU
"""

from __future__ import annotations

import argparse
import sys

from cute_mla.playground import require_gpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1x1024x64", help="b x s_q x h_q (default 1x1024x64)")
    args = ap.parse_args()
    require_gpu(__file__, hint="`cute-mla compile --arch sm_90a --kernel sparse_decode --out DIR` compiles the kernel here")

    import torch

    from cute_mla.archs import SM90, device_arch
    from cute_mla.formats import V32
    from cute_mla.kernels.sm90 import Sm90Tuning
    from cute_mla.playground import bench

    if device_arch(torch.device("cuda")) != SM90.name:
        sys.exit(f"04_try_a_variant.py: Sm90Tuning is the SM90 kernel's; this GPU runs {device_arch(torch.device('cuda'))}")
    try:
        shape = bench.parse_shape(args.shape, V32)
    except ValueError as e:
        sys.exit(str(e))

    variant = Sm90Tuning(prefetch_rows=False)          # the one value changed
    meta, rows = bench.run([shape], V32, tuning=variant, progress=lambda line: print(line, file=sys.stderr))
    print(bench.table(meta, rows))
    bad = bench.failed(rows)
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    r = rows[0]
    print(f"\nprefetch_rows=False runs at {r['variant_vs_default']:.3f}x the default's speed on {shape} "
          f"(below 1: the prefetch helps here); both within FlashMLA's tolerances of the fp32 reference.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
