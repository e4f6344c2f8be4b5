"""Where the tensors a program puts on "cuda" go while the CUDA emulation runs
(``cuda_emulation.py``): :class:`FakeCuda` makes fake tensors on the trace's fake mode (a
prediction), :class:`CpuForCuda` makes real CPU tensors (a real CPU run of the same program,
``measure/program.py``). Both follow :class:`DeviceMapping`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only

from vramledger.inputs.categories import Category
from vramledger.trace.core.premul_sum import REDUCTIONS, reduce_then_scale
from vramledger.trace.core.value_stand_ins import FROM_DATA
from vramledger.trace.core.values import KNOWN_VALUE_CAP_BYTES
from vramledger.trace.program.host_stand_ins import HostStandIns, meta_of


class DeviceMapping(Protocol):
    """Where tensors the program puts on "cuda" go."""

    def factory(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any: ...

    def move(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...

    def module(self, module: nn.Module, dtype: torch.dtype | None) -> None: ...

    def handles(self, func: Any, args: tuple) -> bool: ...

    def answer(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any: ...

    def host_factory(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A host tensor made without data (``host_stand_ins.py``), or None: make it for
        real."""
        ...

    def reported_device(self) -> tuple[FakeTensorMode, torch.device] | None:
        """The fake mode whose CPU tensors stand for CUDA ones and the device object they
        report (:class:`FakeCuda`), or None where "cuda" tensors report their own device."""
        ...


class FakeCuda:
    """ "cuda" tensors are fake CPU tensors of ``mode``: factories run under it, a real tensor
    moved to "cuda" is copied into it (an operator the tracker records; its values stay known,
    ``trace/core/values.py``), a module's parameters and buffers become fake tensors registered with
    ``register(tensors, category)`` (no operator makes them, as in ``trace/core/fake.py``).
    ``values``: answers reads of fake values (``value_stand_ins.py``); ``host``: makes the
    tensors of modules the program builds on the host without data (``host_stand_ins.py``);
    ``moves``: told of each module moved, before (``before_move``) and after its tensors are
    converted (``after_move``), before they are registered (``program_blocks.ShallowModel``)."""

    def __init__(
        self,
        mode: FakeTensorMode,
        register: Callable[[list[torch.Tensor], Category], None],
        values: Any = None,
        host: HostStandIns | None = None,
        moves: Any = None,
        parameter_move: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        reports_cuda: bool = False,
    ) -> None:
        self.mode = mode
        self.reports_cuda = reports_cuda
        """Emulated tensors report a CUDA device to the program (``device.type == "cuda"``,
        ``is_cuda``), so that library code that branches on them takes its GPU path: the
        prediction of a GPU run. Else they report the CPU (by identity the GPU: below), the
        path a real CPU run (``--target cpu``, ``--measure``) takes."""
        self.register = register
        self.values = values
        self.host = host
        self.moves = moves
        self.parameter_move = parameter_move
        """A parameter class's own move to the GPU, for ``Module.cuda()``/``.to("cuda")``
        (bitsandbytes' quantizing parameters: ``bnb_weights.EmulatedQuantization.move``);
        None where the parameter is moved as any other."""
        self.device = torch.device("cuda", 0) if reports_cuda else torch.device("cpu")
        """The device object ``mode``'s CPU tensors report while the emulation runs
        (``FakeTensor.device``, patched by :class:`CudaEmulation`): equal to the CPU, which they
        are, and by its identity the GPU they stand for. ``torch.empty(n, device=x.device)``
        makes a CUDA tensor in the program's GPU run; here it is given this object, so it is
        made by :meth:`factory` (a fake tensor), not as a real CPU tensor that the trace would
        only see from its first use with a fake one (``program_tracker.ProgramTracker``), with
        every operator among such tensors before that unseen. TRL's chunked log-prob
        (``trl/kernels/chunked_logprob.py``) makes its logit tiles, fp32 gradient accumulators
        and statistics this way. A device rebuilt from the object (``torch.device(x.device)``,
        ``x.device.type``) is a new object and is not recognised."""

    def reported_device(self) -> tuple[FakeTensorMode, torch.device]:
        return self.mode, self.device

    def to_host(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """``t.to("cpu")`` / ``t.cpu()`` of an emulated tensor where it reports CUDA: a host
        copy, which the device's allocator never sees. Its values where known (a real tensor),
        else a host stand-in of its shape (``host_stand_ins.py``: its values read as the
        stand-in)."""
        known = getattr(self.values, "values", None)
        if known is not None and known.known(t):
            with unset_fake_temporarily(), _disable_current_modes():
                return known.value(t).to(dtype=dtype, copy=True)
        return self.host_like(torch.empty_like, (t,), {"dtype": dtype or t.dtype})

    def module_to_host(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        """``module.cpu()`` / ``module.to("cpu")`` where emulated tensors report CUDA: each
        emulated parameter and buffer is replaced by its host copy (:meth:`to_host`), so the
        device memory is freed once nothing else holds it, as on a GPU. New parameter objects:
        a fake tensor cannot be swapped into the old one's place in another mode."""
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and self.emulated(p):
                    host = self.to_host(p, dtype if p.is_floating_point() else None)
                    sub._parameters[name] = nn.Parameter(host, requires_grad=p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None and self.emulated(b):
                    sub._buffers[name] = self.to_host(b, dtype if b.is_floating_point() else None)

    def host_like(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` made on the host (``device="cpu"``) from emulated tensors
        (``torch.empty_like(x, device="cpu")``: torchtune's activation offloading): a host
        stand-in of the shape it would have."""
        args, kwargs = tree_map_only(FakeTensor, meta_of, (args, kwargs))
        kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        with unset_fake_temporarily(), _disable_current_modes():
            shaped = func(*args, **{**kwargs, "device": "meta"})
            if self.host is None:
                return torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype)
        with self.host.mode:
            return torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype)

    def factory(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if func in FROM_DATA and args and self.values is not None:
            found = self.values.data_of(func, args[0])
            if found is not None and not found[1]:
                # values computed from parameters: the tensor, of its shape, with none
                with unset_fake_temporarily(), _disable_current_modes():
                    like = func(found[0], dtype=kwargs.get("dtype"))
                with self.mode:
                    return torch.empty(
                        like.shape,
                        dtype=like.dtype,
                        device="cpu",
                        requires_grad=bool(kwargs.get("requires_grad")),
                    )
            if found is not None:
                args = (found[0], *args[1:])
        with self.mode:
            return func(*args, **{**kwargs, "device": "cpu"})

    def emulated(self, t: Any) -> bool:
        """``t`` is on the emulated device (a fake tensor of this mode)."""
        return isinstance(t, FakeTensor) and t.fake_mode is self.mode

    def host_factory(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return None if self.host is None else self.host.factory(func, args, kwargs)

    def move(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if self.emulated(t):
            return t if dtype is None or dtype == t.dtype else t.to(dtype)
        if t.nbytes > KNOWN_VALUE_CAP_BYTES or isinstance(t, FakeTensor) or t.is_meta:
            # values this large are never kept (trace/core/values.py), a meta tensor has none
            # (Lightning's empty init), and the copy under the mode would run for real (FakeTensorMode propagates constants through ``_to_copy``),
            # reading every page: a checkpoint read as shapes (checkpoint_shapes.py) has none
            out = self._fake(t, dtype)
            self.register([out], Category.INPUTS)
            return out
        with self.mode:
            out = t.to("cpu", dtype=dtype, copy=True)
        self.register([out], Category.INPUTS)
        return out

    def _fake(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if self.emulated(t):
            return t if dtype is None else t.to(dtype)
        meta = meta_of(t)
        if dtype is not None and (t.is_floating_point() or t.is_complex()):
            meta = meta.to(dtype)
        converter = self.mode.fake_tensor_converter
        return converter.from_meta_and_device(self.mode, meta, torch.device("cpu"))

    def _parameter(self, p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The fake parameter, in ``p``'s own object where possible: ``Module.to("cuda")``
        keeps each Parameter object, so an optimizer made before the move (as accelerate's
        ``prepare`` allows) steps the moved parameters. The fake takes the real one's place
        (``torch.utils.swap_tensors``, as ``Module._apply`` does under
        ``torch.__future__.set_swap_module_params_on_conversion``); a fake made by
        ``FakeTensor`` itself has no weak reference, which the swap refuses. Where ``p`` has
        one, a new Parameter object."""
        meta = meta_of(p)
        if dtype is not None and p.is_floating_point():
            meta = meta.to(dtype)
        fake = FakeTensor(self.mode, meta, torch.device("cpu"))
        fake.requires_grad_(p.requires_grad)
        fake._is_param = True
        if self.host is not None and self.host.owns(p):
            # A host stand-in (host_stand_ins.py) has weak references (its mode keeps them),
            # which the swap refuses: it takes the fake's data and mode in place instead.
            with torch.no_grad():
                p.data = fake
            p.fake_mode = self.mode
            return p
        try:
            torch.utils.swap_tensors(p, fake)
        except RuntimeError:
            return nn.Parameter(self._fake(p, dtype), requires_grad=p.requires_grad)
        return p

    def module(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        if self.moves is not None:
            self.moves.before_move(module)
        memo: dict[int, torch.Tensor] = {}
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is None:
                    continue
                if id(p) not in memo and self.emulated(p) and dtype in (None, p.dtype):
                    memo[id(p)] = p  # already on the emulated device
                elif (
                    id(p) not in memo
                    and (own := self.parameter_move and self.parameter_move(p)) is not None
                ):
                    memo[id(p)] = own
                    params.append(own)
                elif id(p) not in memo:
                    grad = None if p.grad is None else self._fake(p.grad, dtype)
                    memo[id(p)] = self._parameter(p, dtype)
                    if grad is not None:
                        memo[id(p)].grad = grad
                    params.append(memo[id(p)])
                sub._parameters[name] = memo[id(p)]
            for name, b in sub._buffers.items():
                if b is None:
                    continue
                if id(b) not in memo:
                    memo[id(b)] = self._fake(b, dtype if b.is_floating_point() else None)
                    buffers.append(memo[id(b)])
                sub._buffers[name] = memo[id(b)]
        if self.moves is not None:
            self.moves.after_move(module)
        self.register(params, Category.PARAMETERS)
        self.register(buffers, Category.BUFFERS)

    def handles(self, func: Any, args: tuple) -> bool:
        return self.values is not None and self.values.handles(func, args)

    def answer(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.values.answer(func, args, kwargs)


class CpuForCuda:
    """ "cuda" is the CPU: real tensors, nothing copied (``Tensor.to("cuda")`` of a CPU tensor
    is that tensor). ``parameter_move``: as :class:`FakeCuda`'s (a parameter class that moves
    itself: bitsandbytes quantizes its weights on the way)."""

    reports_cuda = False

    def __init__(
        self, parameter_move: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    ) -> None:
        self.parameter_move = parameter_move

    def factory(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        return func(*args, **{**kwargs, "device": "cpu"})

    def move(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return t if dtype is None else t.to(dtype)

    def module(self, module: nn.Module, dtype: torch.dtype | None) -> None:
        if self.parameter_move is not None:
            for sub in module.modules():
                for name, p in sub._parameters.items():
                    moved = None if p is None else self.parameter_move(p)
                    if moved is not None:
                        sub._parameters[name] = moved
        if dtype is not None:
            module.to(dtype)

    def handles(self, func: Any, args: tuple) -> bool:
        return func in REDUCTIONS  # NCCL's PREMUL_SUM, which gloo refuses (premul_sum.py)

    def answer(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return reduce_then_scale(func, args, kwargs)

    def host_factory(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        return None  # built for real

    def reported_device(self) -> None:
        return None
