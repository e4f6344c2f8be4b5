"""Values a fake-tensor trace can know: those computed only from the user's batch and constants.

Fake tensors carry shapes, not values, so operators whose output *shape* depends on values —
``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``bincount``, ``.item()`` — cannot
run on them. But the batch is real: the token ids, the labels, the attention mask, the offsets of
packed sequences are known before the step runs, and so is everything computed from them and
from constants alone (``labels != -100``, ``attention_mask.sum(-1)``, ``torch.arange(seq)``).
:class:`KnownValues` keeps, beside each fake storage whose contents are known this way, a real
CPU storage holding them, runs every operator whose inputs are all known for real as well as on
fake tensors, and answers value-dependent operators from the real result — so a masked loss gets
the true number of masked positions, exactly as the real run would.

Values that depend on parameters (a router's choice of experts in a mixture-of-experts layer)
cannot be known. They are given by a stated **routing** at the operator that makes the choice
(``topk``, ``argmax``, ``max.dim`` over a tensor computed from parameters), for ``rows`` tokens
each choosing ``k`` of ``n`` experts:

- ``balanced`` (the default): token ``r`` picks ``(r*k + j) mod n`` — every expert gets the same
  number of tokens (to within one);
- ``first`` / ``last``: the first ``ceil(n/k)`` tokens spread over every expert once (so every
  expert runs), and every other token picks the first (or last) ``k`` experts, which thus hold
  nearly every token.

In a top-k layer every token reaches exactly ``k`` experts whatever the routing, so what is saved
in total does not depend on it; only per-expert buffers and their timing do. When no
value-dependent operator consumed a routed value (transformers' grouped-mm experts), the trace is
exact for every routing; otherwise :attr:`KnownValues.routing_dependent` names the operators,
and ``predict/step.py`` traces all three routings and reports each peak. Their largest (``worst``)
bounds every routing for experts run in a loop in index order — the loop transformers' eager
experts use — whose buffers grow with each expert's tokens: in forward, the expert processed last
holds its largest buffers while the others' saved activations are alive (``last``); in backward,
which visits the experts in reverse, the first experts' saved activations stay alive longest
(``first``); and both run every expert, so buffers made once per expert run (the full-size
gradient of ``weight[e]`` that indexing a 3-D expert weight makes in backward) are all made. Each
routing is checked against a real run whose router is forced to it
(``tests/test_real_inputs.py``).

A known storage is forgotten when an operator with an unknown input writes into it. Outputs over
``KNOWN_VALUE_CAP_BYTES`` (``OPTIMIZER_KNOWN_VALUE_CAP_BYTES`` in the optimizer step) are not
kept (their values stay unknown), and a value-dependent
operator on an unknown value still stops the trace with a message naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from vramledger.trace.core.value_operators import PARTLY_KNOWN

aten = torch.ops.aten

Routing = Literal["balanced", "first", "last"]
CONCRETE_ROUTINGS: tuple[str, ...] = ("balanced", "first", "last")
"""Routings a trace answers routers with; ``worst`` is the largest of the three (predict.py)."""

KNOWN_VALUE_CAP_BYTES = 64 * 1024**2
"""Largest output whose real values are kept (a causal mask of 4096 x 4096 in fp32 is 64 MiB);
larger outputs stay unknown, so the real computation never costs more than this per operator."""

OPTIMIZER_KNOWN_VALUE_CAP_BYTES = 64 * 1024
"""The cap in the optimizer step: step counters, learning rates and quantization tables stay
known; the states' values never decide a shape there, and computing them for real (an 8-bit
optimizer's zero-initialised codes and scales, dequantized and requantized at its first step)
took a third of its trace."""

VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake kernel raises when its output (shape or Python value) depends on tensor values."""

UNIFORM_DRAWS = frozenset({aten.rand.default, aten.rand_like.default, aten.uniform_.default})
"""Random draws whose values the trace fixes (``KnownValues._draw``)."""
ROUTING_OPS = frozenset({aten.topk.default, aten.argmax.default, aten.max.dim})
"""Operators whose index output is a choice among ``n`` (experts); on a tensor computed from
parameters the routing policy answers it."""


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors an operator writes into (in-place and ``out=`` arguments)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    out: list[torch.Tensor] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _nondeterministic(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


class KnownValues:
    """Real values kept beside fake storages (see the module docstring).

    ``call(func, args, kwargs)`` replaces ``func(*args, **kwargs)`` inside a dispatch mode that
    sits above the ``FakeTensorMode``.
    """

    def __init__(self, mode: FakeTensorMode, routing: Routing = "balanced") -> None:
        if routing not in CONCRETE_ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}")
        self.mode = mode
        self.routing = routing
        self._real: dict[int, torch.UntypedStorage] = {}  # fake StorageImpl address -> real
        self._refs: dict[int, weakref.ref] = {}
        self._routed: set[int] = set()  # storages whose values come from the routing policy
        self.routing_dependent: dict[str, str] = {}
        """Value-dependent operators that read routed values: operator -> module."""
        self.routed_ops: set[str] = set()
        """Operators the routing policy answered."""
        self.module: Callable[[], str | None] = lambda: None
        """The innermost module running (the tracker sets it)."""
        self.draws = 0
        """Uniform random draws answered at the top of their range (``_draw``)."""
        self.seq_len_option = True
        """Whether the batch's sequence length comes from ``--seq-len`` (for hints)."""
        self.pending_scratch = 0
        """Bytes of index tensors the last operator's real kernel makes from boolean masks and
        frees before returning; the tracker records them as the operator's scratch."""
        self.cap = KNOWN_VALUE_CAP_BYTES
        """Largest output whose values are kept now (the tracker lowers it to
        ``OPTIMIZER_KNOWN_VALUE_CAP_BYTES`` in the optimizer step)."""

    # -- the store -------------------------------------------------------------------------------
    def register(self, fake: torch.Tensor, real: torch.Tensor, *, routed: bool = False) -> None:
        """Remember ``real`` as the contents of ``fake`` (same shape, strides and offset)."""
        if not isinstance(fake, FakeTensor) or is_traceable_wrapper_subclass(fake):
            return
        if real.nbytes > self.cap:
            return
        with _disable_current_modes(), unset_fake_temporarily():
            if (
                real.shape != fake.shape
                or real.stride() != fake.stride()
                or real.storage_offset() != fake.storage_offset()
                or real.dtype != fake.dtype
            ):
                fixed = torch.empty_strided(
                    fake.shape, fake.stride(), dtype=fake.dtype, device="cpu"
                )
                fixed.copy_(real)
                real = fixed
        st = fake.untyped_storage()
        key = st._cdata
        self._real[key] = real.untyped_storage()
        if routed:
            self._routed.add(key)
        else:
            self._routed.discard(key)
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, partial(self._forget_key, key))

    def _forget_key(self, key: int, _ref: Any = None) -> None:
        self._real.pop(key, None)
        self._refs.pop(key, None)
        self._routed.discard(key)

    def storages(self) -> set[int]:
        """The ``_cdata`` of the real storages holding known values (vramledger's own, not the
        program's)."""
        return {real._cdata for real in self._real.values()}

    def _key(self, t: torch.Tensor) -> int | None:
        if not isinstance(t, FakeTensor):
            return None
        return t.untyped_storage()._cdata

    def known(self, t: torch.Tensor) -> bool:
        if not isinstance(t, FakeTensor):
            return not is_traceable_wrapper_subclass(t)  # a real tensor (a constant)
        return t.untyped_storage()._cdata in self._real

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """The real tensor behind a known fake one (or a real constant itself)."""
        if not isinstance(t, FakeTensor):
            return t
        storage = self._real[t.untyped_storage()._cdata]
        with _disable_current_modes(), unset_fake_temporarily():
            out = torch.empty(0, dtype=t.dtype, device="cpu")
            out.set_(storage, t.storage_offset(), t.shape, t.stride())
        return out

    def _run_real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _disable_current_modes(), unset_fake_temporarily(), torch.no_grad():
            real_args, real_kwargs = tree_map_only(torch.Tensor, self.value, (args, kwargs))
            return func(*real_args, **real_kwargs)

    def _fake_from_real(self, real: Any) -> Any:
        with unset_fake_temporarily():
            return tree_map_only(torch.Tensor, self.mode.from_tensor, real)

    def _register_outputs(self, fake_out: Any, real_out: Any, routed: bool) -> None:
        for fake, real in zip(_outputs(fake_out), _outputs(real_out), strict=False):
            self.register(fake, real, routed=routed)

    @contextlib.contextmanager
    def formatting(self) -> Iterator[None]:
        """``f"{t}"`` of a known 0-d fake tensor formats its value, as a real tensor's does
        (``Tensor.__format__`` calls ``item()`` only for plain tensors; Switch Transformers names
        an expert module ``f"expert_{idx}"``)."""
        original = FakeTensor.__format__

        def __format__(t: FakeTensor, spec: str) -> str:
            if t.dim() == 0 and self.known(t):
                if self._key(t) in self._routed:
                    self.routing_dependent.setdefault("Tensor.__format__", self.module() or "")
                with _disable_current_modes(), unset_fake_temporarily():
                    value = self.value(t).item()
                return format(value, spec)
            return original(t, spec)

        FakeTensor.__format__ = __format__  # type: ignore[method-assign]
        try:
            yield
        finally:
            FakeTensor.__format__ = original  # type: ignore[method-assign]

    # -- the dispatch hook -----------------------------------------------------------------------
    def call(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[..., Any] | None = None,
    ) -> Any:
        """``func(*args, **kwargs)`` on fake tensors (through ``run``, which may substitute the
        fake kernel), with the real values computed alongside where they can be known."""
        self.pending_scratch = 0
        run = run or func
        if func in UNIFORM_DRAWS:
            return self._draw(func, run, args, kwargs)
        tensors = list(_tensors(args, kwargs))
        all_known = not _nondeterministic(func) and all(self.known(t) for t in tensors)
        if not all_known:
            return self._partly_known(func, run, args, kwargs, tensors)
        routed = any(self._key(t) in self._routed for t in tensors)
        try:
            fake_out = run(*args, **kwargs)
        except VALUE_DEPENDENT:
            # The output depends on the values, which are known: take it from the real run.
            if routed:
                self.routing_dependent.setdefault(str(func), self.module() or "")
            real_out = self._run_real(func, args, kwargs)
            fake_out = self._fake_from_real(real_out)
            self._register_outputs(fake_out, real_out, routed)
            return fake_out
        if _is_view(func) or not _outputs(fake_out):
            if written := _written(func, args, kwargs):
                self._run_real(func, args, kwargs)  # in place on known values: keep them current
                if routed:  # counts scattered from routed ids are routed too
                    self._routed.update(self._key(t) for t in written)
            elif any(not self.known(o) for o in _outputs(fake_out)):
                # a view of a real constant becomes a new fake storage (``lift_fresh``)
                self._register_outputs(fake_out, self._run_real(func, args, kwargs), routed)
            return fake_out
        if sum(o.nbytes for o in _outputs(fake_out)) > self.cap:
            for t in _written(func, args, kwargs):
                self.forget(t)
            return fake_out
        real_out = self._run_real(func, args, kwargs)
        self._register_outputs(fake_out, real_out, routed)
        return fake_out

    def _draw(
        self, func: Any, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A uniform random draw, known at the top of its range: ``draw < p`` is False, so
        layerdrop (``if torch.rand([]) < self.layerdrop: skip``) keeps every layer — the most
        memory any draw can take."""
        out = run(*args, **kwargs)
        target = args[0] if func is aten.uniform_.default else out
        high = (
            float(args[2] if len(args) > 2 else kwargs.get("to", 1.0))
            if func is aten.uniform_.default
            else 1.0
        )
        if isinstance(target, FakeTensor) and target.nbytes <= self.cap:
            with _disable_current_modes(), unset_fake_temporarily():
                top = torch.nextafter(torch.tensor(high), torch.tensor(float("-inf")))
                value = torch.full(target.shape, top.item(), dtype=target.dtype)
            self.register(target, value)
            self.draws += 1
        return out

    def forget(self, t: torch.Tensor) -> None:
        key = self._key(t)
        if key is not None and key in self._real:
            self._forget_key(key)

    def _partly_known(
        self,
        func: Any,
        run: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> Any:
        for t in _written(func, args, kwargs):
            self.forget(t)
        handler = PARTLY_KNOWN.get(func)
        if handler is not None and any(self.known(t) for t in tensors):
            out = handler(self, func, args, kwargs)
            if out is not NotImplemented:
                return out
        out = run(*args, **kwargs)
        if func in ROUTING_OPS:
            self._route(func, args, kwargs, out)
        return out

    # -- routing policy --------------------------------------------------------------------------
    def _route(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Give the index output of a choice over a computed tensor the policy's values."""
        x = args[0]
        if func is aten.topk.default:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices = out[1]
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                return  # argmax over everything: one scalar, no routing
            indices = out[1] if func is aten.max.dim else out
        n = x.shape[dim]
        if n <= 1 or indices.nbytes > self.cap:
            return
        dim = dim % max(indices.dim(), 1)
        with _disable_current_modes(), unset_fake_temporarily():
            moved = list(indices.shape)
            moved.append(moved.pop(dim))  # the chosen dimension last
            rows = indices.numel() // max(moved[-1], 1)
            values = policy_choices(self.routing, rows, moved[-1], n)
            values = values.reshape(moved).movedim(-1, dim).to(indices.dtype)
        self.register(indices, values, routed=True)
        self.routed_ops.add(str(func))


def policy_choices(routing: str, rows: int, k: int, n: int) -> torch.Tensor:
    """The ``k`` choices among ``n`` of each of ``rows`` rows (tokens) under a routing (see the
    module docstring)."""
    r = torch.arange(rows).unsqueeze(1)
    j = torch.arange(k)
    spread = (r * k + j) % n
    if routing == "balanced":
        return spread
    covering = -(-n // k)
    heavy = j if routing == "first" else n - k + j
    return torch.where(r < covering, spread, heavy)
