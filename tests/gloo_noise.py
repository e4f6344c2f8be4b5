"""How far one real multi-process gloo run may be from the prediction, and why: the window every
multi-process test holds (``tests/mesh_real.py``, ``tests/test_deepspeed_real.py``,
``tests/test_library_loops.py``; ``docs/test-bounds.md``).

A run on gloo is the allocator's count of the same step the estimate traces, with two things no
trace sees, both from gloo's worker threads:

- **gloo's own allocations** (:data:`GLOO_WORKER_BYTES`): its collectives allocate a few KiB on
  their worker threads, where no dispatch mode runs.
- **a collective's buffers freed late, or early.** A collective's input and output are held by
  its ``Work`` object, which gloo's worker thread releases when it finishes. Usually the main
  thread drops the last reference, at the point the trace frees them; in some runs the worker
  thread still holds them, and they are live at the main thread's next peak (above the
  prediction), or, more rarely, the worker's release comes first (below). At most one
  collective is in flight at the peak on these steps, so the window is one collective's
  buffers: its output and its input (:func:`late_free_window`).

The window is derived from the traced rank itself (its largest transient collective buffer), not
from a percentage, and the measured runs sit inside it: 21 runs of every case
(``benchmarks/results/noise-2026-12-02-vm.json`` and the clean-clone suites recorded in
``benchmarks/results/README-suite-times.md``) gave late frees of +121,224 … +144,932 bytes on
FSDP2 cases whose largest unit is 128,000 … 262,144 bytes, +2,104,328 with 1,048,576-byte units,
+264 / −784 on tensor parallelism (8,192-byte buffers) and +8,896 … +1,068,668 on DeepSpeed
reductions of up to 200,000 … 2,134,336 bytes. Cases with no transient collective (DDP,
ZeroRedundancyOptimizer, the pipeline's stages) were exact in every run and get no window.
DeepSpeed's engine reduces on one process too (``buffered_allreduce_fallback`` through a gloo
group of one): a clean-clone CI run on another machine counted +404,884 bytes on the one-process
bf16 loop, its 536,980-byte flat gradient buffer freed late, just before the optimizer step
(5,907,578 vs 5,502,694; every run here is exact).
"""

from __future__ import annotations

from vramledger import Ledger
from vramledger.inputs.categories import Category

GLOO_WORKER_BYTES = 8_520
"""What gloo's collectives allocate on their worker threads, over a late free's buffers: the
largest remainder measured in 21 runs (FSDP2's documented loop on 2 ranks: +139,592 =
2 x 65,536 + 8,520; ``tests/mesh_real.py``'s FSDP2 case +139,528 = 2 x 65,536 + 8,456; the
every-run figures are +1,044 … +6,728)."""

TRANSIENT_COLLECTIVE_CATEGORIES = (
    Category.ALL_GATHER_BUFFERS,
    Category.REDUCE_SCATTER_BUFFERS,
    Category.COMM_BUFFERS,
)
"""Buffers a collective makes and drops within the step (FSDP2's all-gather outputs and
reduce-scatter inputs, tensor parallelism's exchanges). DDP's gradient buckets are not among them:
they live from step to step, and gloo's worker never holds their last reference."""

DEEPSPEED_DEFAULT_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's ``reduce_bucket_size`` default (``deepspeed/runtime/zero/config.py``,
``ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT = 5e8``)."""


def largest_transient_collective(ledger: Ledger) -> int:
    """The largest buffer a collective makes and drops in ``ledger``'s traced step (0 if none)."""
    timeline = ledger.timeline
    assert timeline is not None, "a traced ledger carries its timeline"
    return max(
        (
            nbytes
            for nbytes, tag in zip(timeline.nbytes, timeline.tags, strict=True)
            if tag in TRANSIENT_COLLECTIVE_CATEGORIES
        ),
        default=0,
    )


def deepspeed_reduction_bytes(ledger: Ledger, bucket_elements: int, itemsize: int = 2) -> int:
    """The largest flattened reduction DeepSpeed's engine makes (ZeRO-1/2's reduce bucket;
    without ZeRO the engine's flat all-reduce buffer, on one process too): a bucket's worth of
    gradients (at most every trainable parameter) in the gradients' dtype (``itemsize``)."""
    return min(bucket_elements, ledger.trainable_parameters) * itemsize


def late_free_window(exact: int, collective_bytes: int) -> tuple[int, int]:
    """(below, above): ``exact`` (what the case's claim allows), widened where the step has a
    transient collective of ``collective_bytes`` by one such collective freed early (below) or
    late with its input and output (above), plus :data:`GLOO_WORKER_BYTES`."""
    if collective_bytes == 0:
        return exact, exact
    return exact + collective_bytes, exact + 2 * collective_bytes + GLOO_WORKER_BYTES
