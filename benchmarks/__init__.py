"""Benchmarks and measurement tools, run on a GPU from the repository root as ``python -m benchmarks.<tool>``
(each takes ``--help`` anywhere). The maintained set, eight tools:

* ``bench_sparse_decode``: V3.2 side by side with FlashMLA (as vLLM ships it) on the grid: CUDA-graph
  replay, eager, per call in a 16-call graph, transient memory; ``--sustained ROW [--seconds S]
  [--variants ...]``: each library back to back with the SM clock, power and temperature sampled
  (the power cap); ``--v4``: V4 side by side with FlashMLA (the two-pool cache, lengths, sinks),
  each row over several draws of its inputs, both libraries timed interleaved; ``--variant``,
  ``--cold-l2``.
* ``bench_sparse_prefill``: ``flash_mla_sparse_fwd`` side by side with FlashMLA's on FlashMLA's
  sparse prefill performance cases (eager calls, alternating; TFLOP/s, transient memory, a check
  against the fp32 reference); ``--routes``: a prefill chunk on the V3.2 FP8 cache, dequantized
  into a bf16 workspace then ``flash_mla_sparse_fwd``, against the FP8 decode kernel in the
  mixed-batch layout.
* ``variants``: SM90 kernel variants (``Sm90Tuning`` values through the public seam) checked bit
  for bit and timed interleaved; ``+nocomb`` (the decode kernel alone) and ``--parts`` (other
  partition counts) bounds.
* ``profile``: where a call's time goes: per-kernel device time under graph replay (cute-mla and
  FlashMLA, ``--v4`` for V4 rows), ``--ncu`` one call for Nsight Compute, ``--host`` the eager
  call's host time by part, ``--launch`` the decode launch taken apart, ``--timeline`` where a
  CTA's cycles go per phase and ``--spans`` per-CTA spans under a V4 row's plan
  (``Sm90Tuning(timeline=True)``).
* ``cold_start``: a new process's import and first calls, with an empty compile cache and after
  ``cute-mla warmup``.
* ``roofline`` (CPU): ``docs/roofline.png`` from committed results.
* ``release_check.sh`` (``bash benchmarks/release_check.sh``): a release's GPU check in one device
  call: the GPU suite, the V4 and V3.2 grids; ``STEPS=`` also the demo and the GPU examples.
* ``sm100_first_run.sh``: the first run of the SM100 kernel on a B200, step by step.

``results/README.md`` indexes the committed results; ``docs/performance.md`` is the decision record
and names the commit that holds each probe that left this folder.
"""
