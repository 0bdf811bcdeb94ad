"""Benchmarks and measurement tools, run on a GPU from the repository root as ``python -m benchmarks.<tool>``:

* ``bench_sparse_decode``: the side-by-side benchmark with FlashMLA (as vLLM ships it) on the grid,
  CUDA-graph replay, eager, per call in a 16-call graph, transient memory; ``--sustained ROW
  [--seconds S] [--variants ...]``: each library back to back with the SM clock, power and
  temperature sampled (the power-cap probe).
* ``variants``: SM90 kernel variants (``Sm90Tuning`` values through the public seam) checked bit
  for bit and timed interleaved; ``+nocomb`` (the decode kernel alone) and ``--parts`` (other
  partition counts) bounds.
* ``profile_call``: per-kernel device time under graph replay (cute-mla and FlashMLA), and the
  call against its decode kernel and its combine alone; ``--ncu`` one call for Nsight Compute;
  ``--host`` the eager call's host time by part.
* ``timeline``: where a CTA's cycles go (``Sm90Tuning(timeline=True)``).
* ``gpu_check.sh`` (``bash benchmarks/gpu_check.sh``): the GPU tests, the demo and the benchmark in
  one device call.

``results/README.md`` indexes the committed results; ``docs/performance.md`` is the decision record.
"""
