"""What of this machine a CPU target's answer depends on, beside the spec: the CPU kernels'
scratch is measured here (``trace/core/cpu_scratch.py``), and the kernels a CPU runs are chosen
by its instruction sets and the process's intra-op thread count. Read without torch (the answer
cache's key, ``answer_cache.py``)."""

from __future__ import annotations

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Environment variables that set a process's intra-op thread count (torch reads them at its
first parallel region)."""

CPU_KERNEL_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that choose the CPU's kernels: oneDNN's instruction-set cap
(``benchmarks/results/noise-2026-12-02-vm.json``: ``ONEDNN_MAX_CPU_ISA=AVX2`` changes every
bf16 rank's scratch) and ATen's vectorization."""
