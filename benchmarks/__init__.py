"""Benchmarks and measurement tools, run on a GPU from the repository root as ``python -m benchmarks.<tool>``:

* ``bench_sparse_decode``: the side-by-side benchmark with FlashMLA (as vLLM ships it) on the grid,
  CUDA-graph replay, eager, per call in a 16-call graph, transient memory; ``--sustained ROW`` for
  the power-cap probe.
* ``variants``: SM90 kernel variants (``Sm90Tuning`` values through the public seam) checked bit
  for bit and timed interleaved; ``+nocomb`` (the decode kernel alone) and ``--parts`` (other
  partition counts) bounds.
* ``profile_call``: per-kernel device time; ``--ncu`` one call for Nsight Compute; ``--host`` the eager
  call's host time.
* ``timeline``: where a CTA's cycles go (``Sm90Tuning(timeline=True)``).
* ``gpu_check.sh``: the GPU tests, the demo and the benchmark in one device call.

``results/README.md`` indexes the committed results; ``docs/performance.md`` is the decision record.
"""
