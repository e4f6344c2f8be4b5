"""DeepSpeed inside a user's program run as one of torchrun's ranks (``program_world.py``): the
program's own ``deepspeed.initialize(model=..., config=...)`` builds DeepSpeed's real engine,
and its ``engine(batch)`` / ``engine.backward(loss)`` / ``engine.step()`` run as they are, on
the fake process group, as the estimate runs them (``deepspeed_engine.py``).

Nothing is done until the program imports DeepSpeed (a program that does not pays nothing);
from then on, for the rank's run, DeepSpeed's global state is a fresh one
(``deepspeed_runtime.deepspeed_state``: each rank traced in this process starts with no
communication backend and no cached process groups of the rank before), and its accelerator is
the CPU accelerator the estimate uses (fake tensors are CPU tensors), with the shared-memory
collectives refused (a C++ extension DeepSpeed compiles at ``init_distributed``; only its
``inference_all_reduce`` uses them). In a trace the accelerator names the emulated GPU as its
device (``cpu_accelerator(device_name="cuda")``): DeepSpeed's ``module.to(engine.device)``,
its flat buffers and the program's ``.to(model_engine.device)`` land on the emulated GPU, fake,
where a real GPU run has them. A real CPU run (``measure/program.py``) gets the plain CPU
accelerator (:func:`real_program_deepspeed`), which is what DeepSpeed picks there by itself.

Categories are the estimate's (``deepspeed_engine._Labels.watch``): the flat bf16 buffer
``parameters``, the fp32 partition ``master_weights``, the reduce buckets
``gradient_buckets``, the gradients a rank keeps for its partition ``sharded_gradients``;
likewise for ZeRO-3's flat shards and stage 0's optimizer wrappers
(``deepspeed_engine.tag_optimizer_buffers``), and ZeRO-3's gathered parameters
``all_gather_buffers`` (``deepspeed_zero3.gathers_tagged``, shared with the estimate's
``--strategy zero3``). An
fp32 partition is counted as the trainable parameters it stands for, not as parameters
(``program_trace.STANDS_FOR``).

Assumed, as the estimate assumes it: values DeepSpeed reads from its fake tensors (the overflow
check, ``.item()`` of norms) are the value stand-ins' 0, no overflow: the step every run takes
when it does not skip (the notes list each read). Not modelled: DeepSpeed's FusedAdam
(``"optimizer": {"type": "Adam"}`` without ``"torch_adam": true``) is traced with its kernel
standing in (in place, no memory of its own: multi-tensor Adam writes its parameters and moments
where they are; a real CPU run of DeepSpeed's compiled CPU kernel matched it to the byte);
ZeRO-3's checks that every rank has rank 0's parameter order answer with the rank's own list
(``deepspeed_zero3.rank0_lists_own``); the estimate's labels of temporaries (autograd's gradient before the
bucket, the partition's fp32 gradient) are not kept.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from vramledger.inputs.import_hooks import when_imported
from vramledger.parallel.deepspeed_engine import tag_optimizer_buffers
from vramledger.parallel.deepspeed_runtime import (
    FAKE_RUN_WARNINGS,
    cpu_accelerator,
    deepspeed_modules,
    deepspeed_state,
    version,
)
from vramledger.parallel.deepspeed_zero3 import Register, zero3_on_fake_group

EMULATED_DEVICE = "cuda"
"""The device type DeepSpeed's accelerator names in a trace: the emulated GPU's."""


@contextlib.contextmanager
def once_imported(name: str, setup: Callable[[contextlib.ExitStack], None]) -> Iterator[None]:
    """``setup(stack)`` as soon as ``name`` is imported (at once if it is already); whatever it
    enters on ``stack`` is exited when this context ends."""
    with contextlib.ExitStack() as stack, when_imported(name, lambda _module: setup(stack)):
        yield


@contextlib.contextmanager
def program_deepspeed(
    register: Register, used: dict[str, None], notes: dict[str, None]
) -> Iterator[None]:
    """DeepSpeed for one traced rank of a program (module docstring): its state and accelerator
    once the program imports it, the engines the program builds told to the trace
    (``register`` tags their buffers; ``used`` gets the strategy, ``notes`` what was run)."""

    def setup(stack: contextlib.ExitStack) -> None:
        stack.enter_context(
            deepspeed_state(cpu_accelerator(fake=True, device_name=EMULATED_DEVICE))
        )
        stack.enter_context(warnings.catch_warnings())
        for message in FAKE_RUN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        stack.enter_context(_engines_told(register, used, notes))
        stack.enter_context(_hooks_under_their_modes())
        stack.enter_context(_fused_adam_standing_in(notes))
        stack.enter_context(zero3_on_fake_group(register, notes))

    with once_imported("deepspeed", setup):
        yield


@contextlib.contextmanager
def real_program_deepspeed() -> Iterator[None]:
    """DeepSpeed for a program run for real on CPU as one rank (``measure/program.py``): a
    fresh state with DeepSpeed's CPU accelerator (the CUDA emulation must not make it pick its
    CUDA one), the shared-memory collectives not compiled."""

    def setup(stack: contextlib.ExitStack) -> None:
        stack.enter_context(deepspeed_state(cpu_accelerator(fake=False)))

    with once_imported("deepspeed", setup):
        yield


class _Observer:
    """What ``deepspeed_engine._Labels`` tells (``TrackerObserver``'s interface) sent to the
    program trace's ``register``; labels of temporaries are not kept."""

    def __init__(self, register: Register) -> None:
        self.tensors = lambda tensors, category: register(list(tensors), category)

    def label(self, tensors: Any, text: str) -> None:
        pass


@contextlib.contextmanager
def _engines_told(
    register: Register, used: dict[str, None], notes: dict[str, None]
) -> Iterator[None]:
    """Each ``DeepSpeedEngine`` the program builds: its strategy (``zero<stage>``) and a note;
    a ZeRO-1/2 optimizer's buffers tagged as the estimate tags them, from the moment it is
    built (``_configure_optimizer``, after DeepSpeed moved the model to its device)."""
    from vramledger.parallel.deepspeed_engine import _Labels

    modules = deepspeed_modules()
    engine_class = modules.engine_class
    original = engine_class.__dict__["_configure_optimizer"]

    def configure_optimizer(engine: Any, *args: Any, **kwargs: Any) -> Any:
        labels = _Labels(_Observer(register))
        params = [p for p in engine.module.parameters() if p.requires_grad]
        for p in params:  # before DeepSpeed's hooks, so they see autograd's gradient
            p.register_post_accumulate_grad_hook(labels.fresh_gradient)
        out = original(engine, *args, **kwargs)
        stage = engine.zero_optimization_stage()
        used[f"zero{stage}"] = None
        zero = engine.optimizer
        if isinstance(zero, modules.zero_optimizer):
            labels.watch(zero)
        tag_optimizer_buffers(zero, register)
        inner = getattr(zero, "optimizer", zero)
        notes[
            f"DeepSpeed: the program's deepspeed.initialize built DeepSpeed {version()}'s own "
            f"engine (ZeRO stage {stage}, {type(zero).__name__} over "
            f"{type(inner).__name__}), run on the fake process group with DeepSpeed's CPU "
            "accelerator naming the emulated GPU as its device"
        ] = None
        return out

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    initial = FP16_UnfusedOptimizer.__dict__["initialize_optimizer_states"]

    def initialize_optimizer_states(wrapper: Any) -> Any:
        # it steps the optimizer once with zero gradients to make its state: its fp32 copies
        # are master weights from that first step on
        tag_optimizer_buffers(wrapper, register)
        notes[UNFUSED_FIRST_STEP] = None
        return initial(wrapper)

    with (
        mock.patch.object(engine_class, "_configure_optimizer", configure_optimizer),
        mock.patch.object(
            FP16_UnfusedOptimizer, "initialize_optimizer_states", initialize_optimizer_states
        ),
    ):
        yield


UNFUSED_FIRST_STEP = (
    "DeepSpeed's FP16_UnfusedOptimizer (ZeRO stage 0 in bf16/fp16) steps its optimizer once "
    "with zero gradients when it is built, to make the optimizer's state: that is the "
    "program's step 1, in the trace as in a real run"
)


HOOK_REGISTRATIONS = ("register_hook", "register_post_accumulate_grad_hook")
"""``torch.Tensor``'s methods that register a hook autograd's engine calls (DeepSpeed's ZeRO
reduces each gradient from a post-accumulate-grad hook, ``register_grad_hook`` in
deepspeed/utils/torch.py)."""


@contextlib.contextmanager
def _hooks_under_their_modes() -> Iterator[None]:
    """A tensor hook registered while torch function modes are active runs under them.
    Autograd's engine calls hooks with no ``TorchFunctionMode`` on the stack, so DeepSpeed's
    ``torch.empty(n, device=get_accelerator().current_device_name())`` in its gradient hook
    would miss the CUDA emulation's mode (its reduce bucket, made at the first gradient); in a
    GPU run it is a CUDA tensor, so it is made on the emulated GPU, as ``cuda_emulation``
    does for a custom ``autograd.Function``'s backward."""
    from torch.overrides import _get_current_function_mode_stack

    saved = {name: getattr(torch.Tensor, name) for name in HOOK_REGISTRATIONS}

    def under(hook: Callable[..., Any]) -> Callable[..., Any]:
        modes = list(_get_current_function_mode_stack())
        if not modes:
            return hook

        def run(*args: Any, **kwargs: Any) -> Any:
            if _get_current_function_mode_stack():
                return hook(*args, **kwargs)
            with contextlib.ExitStack() as active:
                for mode in modes:
                    active.enter_context(mode)
                return hook(*args, **kwargs)

        return run

    def registering(register: Callable[..., Any]) -> Callable[..., Any]:
        def register_under(t: torch.Tensor, hook: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            return register(t, under(hook), *args, **kw)

        return register_under

    with contextlib.ExitStack() as patched:
        for name, register in saved.items():
            patched.enter_context(mock.patch.object(torch.Tensor, name, registering(register)))
        yield


FUSED_ADAM_NOTE = (
    "DeepSpeed's FusedAdam (the config's Adam/AdamW without torch_adam) traced with its "
    "multi-tensor kernel standing in: it updates the parameters and both moments in place, "
    "allocating nothing"
)


def _in_place(*_args: Any) -> None:
    """FusedAdam's ``multi_tensor_adam(chunk_size, noop_flag, tensor_lists, ...)``: in place."""


class _FusedAdamKernel:
    """``FusedAdamBuilder`` whose ``load()`` gives the kernel standing in (no compilation)."""

    def __init__(self, notes: dict[str, None]) -> None:
        self.notes = notes

    def __call__(self) -> _FusedAdamKernel:
        return self

    def load(self) -> Any:
        self.notes[FUSED_ADAM_NOTE] = None
        return SimpleNamespace(multi_tensor_adam=_in_place)


@contextlib.contextmanager
def _fused_adam_standing_in(notes: dict[str, None]) -> Iterator[None]:
    """DeepSpeed's FusedAdam with its multi-tensor kernel standing in (module docstring): the
    kernel is a C++/CUDA extension DeepSpeed compiles, which cannot run on fake tensors."""
    from deepspeed.ops.adam import fused_adam

    init = fused_adam.FusedAdam.__dict__["__init__"]

    def made_on_device(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        init(optimizer, *args, **kwargs)
        # its kernel's overflow flag, ``get_accelerator().IntTensor([0])``: a CPU tensor of the
        # CPU accelerator, which on a GPU (and in a real CPU run) is the device's 4 bytes
        device = fused_adam.get_accelerator().current_device_name()
        optimizer._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=device)

    with (
        mock.patch.object(fused_adam, "FusedAdamBuilder", _FusedAdamKernel(notes)),
        mock.patch.object(fused_adam.FusedAdam, "__init__", made_on_device),
    ):
        yield
