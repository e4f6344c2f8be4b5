"""Scratch memory that CPU kernels allocate inside themselves, measured by running them.

Some CPU kernels take buffers from the CPU allocator that are neither inputs nor outputs —
oneDNN convolution reorders its weights and gradients (for a ViT-Base patch embedding the
backward takes 20 MiB in fp32, 46 MiB in bf16 on an AVX-512 Xeon), reductions and batch-norm
backward on bf16 accumulate in fp32 buffers — and a dispatch-level tracker never sees them.
Their size depends on the kernel the CPU picks, so for ``--target cpu`` the trace runs each
operator once for real, on zero tensors of the traced shapes, counts the allocator's peak
inside it with ``torch.profiler`` memory events, and records the excess over its new outputs as
transient workspace. Views, in-place operators and factories are not probed (they allocate
nothing but their outputs). Results are cached per (operator, shapes, strides, dtypes,
arguments, intra-op threads); a probe that would need more than ``PROBE_LIMIT_BYTES`` of real
memory is skipped and named in the notes.

The scratch depends on the process's intra-op thread count (``torch.get_num_threads()``):
oneDNN's bf16 matrix products take a buffer per thread. Measured on torch 2.13, a 2-core AMD
EPYC (Zen 4), the tiny Llama's ``aten.mm`` of (128, 176) x (176, 64) in bf16: 83,584 bytes of
scratch with 2 threads, 58,368 with 1; the GPipe case of ``tests/mesh_real.py`` predicts rank 0
20,356 bytes higher with 2 threads than with 1. The answer says the thread count it probed
with (:meth:`CpuScratchProbe.notes`); a run with another (``torchrun`` sets
``OMP_NUM_THREADS=1`` for each of several processes) differs by as much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only

from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.sources import tensor_leaves
from vramledger.record.allocator_events import memory_events, peak_of, recording
from vramledger.trace.core.tracker import StorageTracker
from vramledger.trace.core.wrapped_numbers import held_wrapped_bytes

aten = torch.ops.aten

PROBE_LIMIT_BYTES = 1024**3
"""Largest real memory a probe may use (inputs + outputs, before scratch)."""


VALUE_DEPENDENT = frozenset({aten.masked_select.default})
"""Kernels whose scratch depends on the values, probed on the values the trace knows
(trace/core/values.py) when it knows them all: ``masked_select_out_impl_cpu``
(aten/src/ATen/native/TensorAdvancedIndexing.cpp) sums the mask (through a long copy of it,
8 bytes per element) and returns when nothing is kept; otherwise its parallel path makes a long
copy of the mask and its prefix sum (16 bytes per element). On zeros nothing is kept.
Measured on torch 2.13, 65,536 elements, 2 threads: 524,312 bytes of scratch with no element
kept, 1,048,576 with any (cross-entropy's label-smoothing weight sum, trace/core/plain_autograd.py)."""


NOT_PROBED = frozenset({aten.mkldnn_rnn_layer_backward.default})
"""Kernels that cannot run on the probe's zeros: oneDNN's LSTM backward reads the forward's
``workspace``, which the fake forward makes empty (its meta kernel), and crashes the process on
one (seen with Lightning's ``LightningLSTM`` demo, ``nn.LSTM`` on the CPU, torch 2.13)."""


def probed(func: Any, args: tuple[Any, ...]) -> bool:
    """Operators that may allocate scratch: with tensor inputs, not views, not in-place, but
    ``out=`` variants (they write only into their ``out`` arguments). Inductor's generated code
    calls ``mm``, ``addmm`` and ``bmm`` with ``out=`` (``extern_kernels``): on bf16, the CPU's
    ``mm.out`` takes 26,240 bytes of scratch in a tiny Llama's forward and 20,092 in its
    backward (litgpt pretrain under bf16-mixed), which the trace missed while only functional
    operators were probed."""
    if func in NOT_PROBED:
        return False
    schema = func._schema
    out_variant = any(a.is_out for a in schema.arguments)
    writes_elsewhere = any(
        a.alias_info is not None and a.alias_info.is_write and not a.is_out
        for a in schema.arguments
    )
    if writes_elsewhere or (not out_variant and schema.is_mutable):
        return False
    if not out_variant and any(r.alias_info is not None for r in schema.returns):
        return False
    return bool(tensor_leaves(args))


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _describe(a: Any) -> Any:
    """A hashable description holding no tensor (a cache key must not keep fake tensors alive)."""
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_describe(x) for x in a)
    return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else repr(a)


def _key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return (
        str(func),
        torch.get_num_threads(),
        *(_describe(a) for a in args),
        *((k, _describe(v)) for k, v in sorted(kwargs.items())),
    )


def _real(a: Any) -> Any:
    """``a`` with zeros for its tensors."""
    return tree_map_only(
        torch.Tensor,
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_(),
        a,
    )


def _known(values: Any, a: Any) -> Any:
    """``a`` with the values the trace knows (a copy: the probe must not write into them)."""
    return tree_map_only(torch.Tensor, lambda t: values.value(t).clone(), a)


@dataclass
class ScratchCache:
    """The probes of one estimate, shared by its traces: its ranks (and MoE routings) run the
    same kernels on the same shapes in the same process, so a kernel another of its traces
    probed is not run again. Keys are :func:`_key`'s."""

    scratch: dict[tuple[Any, ...], int] = field(default_factory=dict)
    """Probed scratch bytes (0 for operators not probed)."""
    too_large: dict[tuple[Any, ...], str] = field(default_factory=dict)
    """Keys whose probe was skipped (over ``PROBE_LIMIT_BYTES``): the operator, for each
    trace's notes."""


class CpuScratchProbe:
    """An op observer that adds the measured internal scratch of CPU kernels. ``cache``: the
    probes of the estimate's other traces (:class:`ScratchCache`); a fresh one when not given."""

    def __init__(self, cache: ScratchCache | None = None) -> None:
        self.cache = ScratchCache() if cache is None else cache
        self.skipped: set[str] = set()
        self.threads: set[int] = set()
        """The intra-op thread counts of the probes whose scratch the trace added."""

    def __call__(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tracker: StorageTracker,
    ) -> None:
        if not isinstance(func, torch._ops.OpOverload):
            return
        values = tracker.values
        if (
            func in VALUE_DEPENDENT
            and values is not None
            and all(values.known(t) for t in tensor_leaves([*args, *kwargs.values()]))
        ):
            scratch = self._probe(func, args, kwargs, out, partial(_known, values))
            if scratch is None:
                self.skipped.add(str(func))
            elif scratch > 0:
                self._add(tracker, func, scratch)
            return
        key = _key(func, args, kwargs)
        cache = self.cache
        if key not in cache.scratch:
            probe = self._probe(func, args, kwargs, out) if probed(func, args) else 0
            if probe is None:
                cache.too_large[key] = str(func)
            cache.scratch[key] = probe or 0
        if key in cache.too_large:  # noted by every trace that runs it
            self.skipped.add(cache.too_large[key])
        scratch = cache.scratch[key] - held_wrapped_bytes(func, args)
        if scratch > 0:
            self._add(tracker, func, scratch)

    def _add(self, tracker: StorageTracker, func: Any, scratch: int) -> None:
        tracker.add_transient(scratch, f"{func} CPU kernel scratch")
        self.threads.add(torch.get_num_threads())

    def _probe(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        real: Callable[[Any], Any] = _real,
    ) -> int | None:
        """The kernel's scratch bytes; None when the probe would need more than
        ``PROBE_LIMIT_BYTES`` of real memory (not run)."""
        outs = [
            o
            for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor)
        ]
        needed = sum(_tensor_bytes(a) for a in tensor_leaves([*args, *kwargs.values()]))
        needed += sum(_tensor_bytes(o) for o in outs)
        if needed > PROBE_LIMIT_BYTES:
            return None
        if torch._C._functorch.maybe_current_level() is not None:
            # inside vmap (transformers' mask functions): the tensors are functorch wrappers,
            # which a probe cannot copy; these are index arithmetic, no kernel scratch
            return 0
        with _disable_current_modes(), torch.no_grad():
            real_args = [real(a) for a in args]
            real_kwargs = {k: real(v) for k, v in kwargs.items()}
            inputs = {
                t.untyped_storage()._cdata
                for t in tensor_leaves([*real_args, *real_kwargs.values()])
            }
            try:
                with recording() as prof:
                    result = func(*real_args, **real_kwargs)
            except Exception:  # e.g. values that zeros make invalid; the trace itself ran
                return 0
            results = [
                r
                for r in (result if isinstance(result, (tuple, list)) else (result,))
                if isinstance(r, torch.Tensor)
            ]
            new = {r.untyped_storage()._cdata: _tensor_bytes(r) for r in results}
            kept = sum(b for k, b in new.items() if k not in inputs)
            del result, results, real_args, real_kwargs
        return max(0, peak_of(memory_events(prof)) - kept)

    def notes(self) -> list[str]:
        notes: list[str] = [
            Note(
                Topic.LIMITS,
                f"{op}: CPU kernel scratch not probed (over {PROBE_LIMIT_BYTES // 1024**3} GiB)",
            )
            for op in sorted(self.skipped)
        ]
        if self.threads:
            counts = " and ".join(str(n) for n in sorted(self.threads))
            capability = torch.backends.cpu.get_cpu_capability()
            notes.append(
                Note(
                    Topic.KERNELS,
                    f"CPU kernel scratch measured on this CPU ({capability}) with {counts} "
                    "intra-op thread(s) (torch.get_num_threads()); kernels take scratch per "
                    "thread, so a run with another thread count (torchrun sets "
                    "OMP_NUM_THREADS=1 for several processes) takes other amounts",
                )
            )
        return notes
