"""Every attribute of torch or another library that vramledger replaces, and why: the patch
registry.

To trace a program on fake tensors, emulate a GPU that is not there and drive engines below their
public API, vramledger replaces functions, methods, module globals, configuration flags, kernels
and environment variables of other packages while a trace or a run is active (each restored on
exit). Each :class:`Patch` names one of them: what is replaced (``target``), the module that
replaces it (``by``), why (``reason``), and the distribution whose code it is (``package``),
whose tested range is :func:`tested_range`'s. ``inputs/patch_check.py`` resolves every target
against the installed libraries (``vramledger compat``), so a release that renames or removes
one is found before a trace silently stops being corrected; ``tests/test_patches.py`` keeps the
registry complete (every module with a patching construct is some patch's ``by``).

Importing this module imports no library: the registry is data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vramledger.inputs.compat import TESTED_RANGES

PatchKind = Literal[
    "attribute", "instance", "contents", "closure", "config", "kernel", "environment"
]
"""How a target is replaced: ``attribute``, a module's or class's attribute set to a stand-in;
``instance``, the class's attribute shadowed on the objects concerned only; ``contents``, a
library's container emptied or filled; ``closure``, the cell of a library function's closure;
``config``, a ``torch`` configuration flag (``config.patch``); ``kernel``, an operator's kernel
for one dispatch key (``torch.library.Library(..., "IMPL")``); ``environment``, an environment
variable a library reads."""

PYTHON = "python"
"""The ``package`` of patches of Python's standard library (its version is the interpreter's)."""

DECLARED_RANGES: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.14"),
    "transformers": ("5.24", "5.25"),
    "lightning": ("2.5", "2.7"),
    "triton": ("3.7.1", "3.7.2"),
}
"""Package -> (lowest version, first version not tested) for the patched packages that
``compat.TESTED_RANGES`` does not hold, as ``pyproject.toml`` declares them: torch from the
project's dependencies (``torch>=2.13,<2.14``), transformers from the ``hf`` extra
(``transformers>=5.24,<5.25``), lightning from the ``dev`` extra (``lightning>=2.5,<2.7``), triton
from the ``frameworks`` extra's pin (``triton==3.7.1``). ``tests/test_patches.py`` keeps them
equal to pyproject's. safetensors, huggingface-hub and lightning-fabric have no declared range
(they come with transformers and lightning), nor has Python's standard library beyond
``requires-python``."""


def tested_range(package: str) -> tuple[str, str] | None:
    """``package``'s tested range, ``(low, high)`` for ``>=low,<high``; None where none is
    declared."""
    return TESTED_RANGES.get(package) or DECLARED_RANGES.get(package)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One replacement vramledger makes in another package (module docstring)."""

    target: str
    """What is replaced, as a dotted path (``torch.nn.Module._apply``); ``os.environ['NAME']``
    for an environment variable, ``aten::op (DispatchKey)`` for a kernel; a ``*`` in its last
    part stands for every matching name (a loop over a module's names)."""
    by: str
    """The vramledger module that replaces it, relative to ``src/vramledger``
    (``trace/core/fake_corrections.py``)."""
    reason: str
    """Why, in one line."""
    package: str
    """The distribution whose code the target is (``torch``, ``deepspeed``, ...; ``python``
    for the standard library): its installed version is checked against
    :func:`tested_range`."""
    kind: PatchKind = "attribute"
    """How it is replaced (:data:`PatchKind`)."""
    resolves: str | None = None
    """The dotted path checked for this patch where ``target`` is not one (an instance's
    attribute, a closure cell, a kernel, an environment variable): what must exist for the
    patch to apply, such as the class whose method is shadowed or the function that reads the
    variable. None: ``target`` itself."""
    required: bool = True
    """False where the patch creates the attribute or skips it when the library lacks it
    (``create=True``, a ``hasattr`` check) and nothing is lost then: its absence is reported,
    not a failure."""
    everywhere: bool = False
    """Every module's name for the original is replaced too, not only ``target``
    (``checkpoint_shapes.replace_everywhere``: ``from safetensors import safe_open`` binds it
    under the importer's name)."""
    note: str = ""
    """What else to know (a target computed at run time, the condition it is replaced on)."""

    @property
    def checked(self) -> str:
        """The dotted path :mod:`vramledger.inputs.patch_check` resolves."""
        return self.resolves or self.target

    @property
    def tested_range(self) -> tuple[str, str] | None:
        return tested_range(self.package)

    def to_dict(self) -> dict[str, Any]:
        tested = self.tested_range
        return {
            "target": self.target,
            "by": self.by,
            "reason": self.reason,
            "package": self.package,
            "kind": self.kind,
            "checked": self.checked,
            "required": self.required,
            "everywhere": self.everywhere,
            "note": self.note,
            "tested_range": None if tested is None else f">={tested[0]},<{tested[1]}",
        }


def _each(owner: str, names: Iterable[str], **fields: Any) -> tuple[Patch, ...]:
    """One :class:`Patch` per ``owner.name`` of ``names``, the other fields alike (a loop over
    names in the patching module)."""
    return tuple(Patch(target=f"{owner}.{name}", **fields) for name in names)


def _environment(names: Iterable[str], **fields: Any) -> tuple[Patch, ...]:
    """One environment-variable :class:`Patch` per name of ``names``."""
    return tuple(
        Patch(target=f"os.environ[{name!r}]", kind="environment", **fields) for name in names
    )


# fmt: off
CUDA_FUNCTIONS = (
    "is_available", "is_initialized", "device_count", "current_device", "set_device",
    "get_device_properties", "get_device_name", "get_device_capability", "is_bf16_supported",
    "synchronize", "empty_cache", "init", "_lazy_init", "manual_seed", "manual_seed_all", "seed",
    "seed_all", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "memory_cached", "max_memory_cached", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "memory_stats", "mem_get_info",
    "memory_summary", "utilization", "Event", "Stream", "current_stream", "default_stream",
    "stream", "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all",
    "set_per_process_memory_fraction", "reset_accumulated_memory_stats", "ipc_collect", "device",
    "device_of",
)
# fmt: on
"""``torch.cuda``'s names the CUDA emulation answers (``trace/emulation/cuda_api.py``:
``cuda_functions``; ``tests/test_patches.py`` keeps the two equal)."""

# fmt: off
CUDA_MEMORY_FUNCTIONS = (
    "is_initialized", "empty_cache", "_lazy_init", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_stats", "mem_get_info", "memory_summary", "set_per_process_memory_fraction",
    "reset_accumulated_memory_stats",
)
# fmt: on
"""Those of :data:`CUDA_FUNCTIONS` that ``torch.cuda.memory`` defines in torch 2.13 (the
emulation replaces there only the names the module has)."""

# fmt: off
ACCELERATOR_FUNCTIONS = (
    "current_accelerator", "is_available", "device_count", "current_device_index",
    "current_device_idx", "set_device_index", "set_device_idx", "device_index", "synchronize",
    "empty_cache", "empty_host_cache", "current_stream", "set_stream", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "reset_peak_memory_stats", "reset_accumulated_memory_stats", "get_memory_info",
)
# fmt: on
"""``torch.accelerator``'s names the emulation answers (``cuda_api.accelerator_functions``),
replaced in ``torch.accelerator`` and ``torch.accelerator.memory`` where each defines them."""

# fmt: off
ACCELERATOR_MEMORY_FUNCTIONS = (
    "empty_cache", "empty_host_cache", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "get_memory_info",
)
# fmt: on
"""Those of :data:`ACCELERATOR_FUNCTIONS` that ``torch.accelerator.memory`` defines in torch 2.13."""

NVTX_FUNCTIONS = ("range_push", "range_pop", "mark", "range_start", "range_end", "range")
"""``torch.cuda.nvtx``'s functions, no-ops under the emulation (``cuda_emulation.py``)."""

# fmt: off
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)
# fmt: on
"""The variables torchrun sets, set for each traced rank (``torchrun_env.TorchrunRank
.environment``; ``tests/test_patches.py`` keeps the two equal)."""

# fmt: off
PARALLEL_STYLES = (
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
)
# fmt: on
"""torch's ``ParallelStyle`` classes that define ``_apply`` (torch 2.13's
``torch/distributed/tensor/parallel/style.py``)."""

LIGHTNING_BNB = "lightning.fabric.plugins.precision.bitsandbytes"
DEEPSPEED_ZERO = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
DEEPSPEED_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
CPU_ACCELERATOR = "deepspeed.accelerator.cpu_accelerator.CPU_Accelerator"
PIPELINE_STAGE = "torch.distributed.pipelining.stage.PipelineStage"
FSDP2 = "torch.distributed.fsdp._fully_shard"
DDP = "torch.nn.parallel.DistributedDataParallel"
ENV_RENDEZVOUS = "torch.distributed.rendezvous._env_rendezvous_handler"
"""torch's ``env://`` rendezvous, which reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
``WORLD_SIZE``."""

TRANSFORMERS_READERS = {
    "TRANSFORMERS_VERBOSITY": "transformers.utils.logging._get_default_logging_level",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "transformers.utils.logging.warning_advice",
}
"""transformers' logging variables -> the function that reads each."""

_EMULATION = "trace/emulation/cuda_emulation.py"
_SYNCHRONOUS = "transformers.core_model_loading.convert_and_load_state_dict_in_model"

PATCHES: tuple[Patch, ...] = (
    # -- trace/core: the tracker and its fixes ------------------------------------------------
    Patch(
        target="torchao.optim.adam.single_param_adam",
        by="trace/core/step_memo.py",
        reason="a per-parameter step whose argument layout was seen replays its recorded events "
        "instead of running",
        package="torchao",
    ),
    Patch(
        target="torch.distributed.tensor._sharding_prop.ShardingPropagator"
        "._propagate_tensor_meta_non_cached",
        by="trace/core/dtensor_compat.py",
        reason="DTensor's sharding propagation runs outside the trace's modes, as on a GPU (its "
        "global-shape fake tensors are no rank's memory)",
        package="torch",
    ),
    Patch(
        target="torch.nn.Module._apply",
        by="trace/core/fake_corrections.py",
        reason="a .to() that changes nothing leaves fake parameters alone; one that does converts "
        "in place where a fake parameter cannot be swapped",
        package="torch",
    ),
    Patch(
        target="torch.UntypedStorage.resize_",
        by="trace/core/storage_resize.py",
        reason="a storage resize frees or allocates memory without an operator (FSDP2): the "
        "tracker records it",
        package="torch",
    ),
    Patch(
        target="torch._subclasses.fake_tensor.FakeTensor.__format__",
        by="trace/core/values.py",
        reason="f'{t}' of a 0-d fake tensor with a known value formats the value, as a real "
        "tensor's does (Switch Transformers' expert names)",
        package="torch",
    ),
    Patch(
        target="torch.nn.functional.linear",
        by="trace/core/plain_branches.py",
        reason="which linear is running, so a bias a plain run adds in place is seen",
        package="torch",
    ),
    Patch(
        target="transformers.utils.import_utils.is_fake_tensor",
        by="trace/core/hf_compat.py",
        reason="a fake tensor with known values is not 'being traced': transformers' mask checks "
        "read its values and take the real run's branch",
        package="transformers",
    ),
    Patch(
        target="transformers.masking_utils.find_packed_sequence_indices",
        by="trace/core/hf_compat.py",
        reason="the packed-sequence check runs eagerly and answers 'not packed' where it needs "
        "values (a note says so)",
        package="transformers",
    ),
    Patch(
        target="transformers.masking_utils.is_tracing",
        by="trace/core/hf_compat.py",
        reason="False inside the packed-sequence check, so it runs its eager path",
        package="transformers",
    ),
    # -- trace/compile: compiled regions ------------------------------------------------------
    Patch(
        target="torchao.optim.adam.single_param_adam",
        by="trace/compile/compiled.py",
        reason="torchao's step, which it torch.compiles at each call, runs as Inductor's "
        "generated code (a compiled region)",
        package="torchao",
    ),
    Patch(
        target="torch._dynamo.eval_frame.OptimizedModule.__call__",
        by="trace/compile/compiled.py",
        reason="a torch.compile'd module runs its graph as Inductor's generated code, under the "
        "trace",
        package="torch",
        note="its instance's forward is replaced for the call",
    ),
    Patch(
        target="torch._dynamo.eval_frame._callback_from_stance",
        by="trace/compile/compiled.py",
        reason="finds the torch.compile wrapper that asks, to send its calls to a compiled region",
        package="torch",
    ),
    Patch(
        target="torch._dynamo.eval_frame._TorchDynamoContext.__call__.<locals>.compile_wrapper",
        by="trace/compile/compiled.py",
        reason="a user's torch.compile wrapper calls its function as a compiled region (its "
        "'fn' cell), restored at the end",
        package="torch",
        kind="closure",
        resolves="torch._dynamo.eval_frame._TorchDynamoContext.__call__",
        note="also an nn.Module.compile()'d module's forward, replaced in its __dict__ per call",
    ),
    *_each(
        "torch.nn.modules.module",
        ("_global_forward_pre_hooks", "_global_forward_hooks"),
        by="trace/compile/compiled.py",
        reason="the trace's global module hooks are set aside while Dynamo traces a region and "
        "it runs",
        package="torch",
        kind="contents",
        note="the trace's own hooks on the region's modules too",
    ),
    *_each(
        "torch._dynamo.pgo",
        ("_CODE_STATE", "_INIT_CODE_STATE", "_LOGGED_DYNAMIC_ALLOWLIST"),
        by="trace/compile/compiled.py",
        reason="the caller's automatic-dynamic record is put back after a trace (the trace's "
        "fresh Dynamo clears it, and the sizes the trace's regions compiled at are not the "
        "caller's)",
        package="torch",
    ),
    Patch(
        target="torch._dynamo.config.fail_on_recompile_limit_hit",
        by="trace/compile/compiled.py",
        reason="a region that would recompile past the limit raises, and runs eagerly with a note",
        package="torch",
        kind="config",
    ),
    Patch(
        target="torch._inductor.codecache.PyCodeCache.load_by_key_path",
        by="trace/compile/inductor_stub.py",
        reason="Inductor's wrapper module is loaded with its kernels uncompiled no-ops, its "
        "buffers made under the trace",
        package="torch",
    ),
    Patch(
        target="torch._inductor.async_compile.AsyncCompile",
        by="trace/compile/inductor_stub.py",
        reason="while a wrapper module executes, every kernel it compiles is a no-op",
        package="torch",
    ),
    Patch(
        target="torch._functorch.config.force_non_lazy_backward_lowering",
        by="trace/compile/inductor_stub.py",
        reason="a region's backward graph is compiled with its forward, while the trace's modes "
        "are aside",
        package="torch",
        kind="config",
    ),
    # -- trace/emulation: the emulated GPU ----------------------------------------------------
    *_each(
        "torch.cuda",
        CUDA_FUNCTIONS,
        by=_EMULATION,
        reason="torch.cuda answers as the emulated GPU: properties, memory from the trace's "
        "count, nothing to wait for",
        package="torch",
        required=False,
        note="created where torch lacks it (mock.patch.object create=True)",
    ),
    *_each(
        "torch.cuda.memory",
        CUDA_MEMORY_FUNCTIONS,
        by=_EMULATION,
        reason="torch.cuda.memory's own names answer as torch.cuda's do",
        package="torch",
        required=False,
        note="only where the module defines the name",
    ),
    *_each(
        "torch.accelerator",
        ACCELERATOR_FUNCTIONS,
        by=_EMULATION,
        reason="torch.accelerator answers as a CUDA build with the emulated GPU (a CPU-only "
        "build has no accelerator)",
        package="torch",
        required=False,
        note="only where the module defines the name",
    ),
    *_each(
        "torch.accelerator.memory",
        ACCELERATOR_MEMORY_FUNCTIONS,
        by=_EMULATION,
        reason="torch.accelerator.memory answers as torch.accelerator does",
        package="torch",
        required=False,
        note="only where the module defines the name",
    ),
    Patch(
        target="torch.distributed.is_nccl_available",
        by=_EMULATION,
        reason="a CUDA build has NCCL",
        package="torch",
    ),
    Patch(
        target="torch.cuda.nccl.version",
        by=_EMULATION,
        reason="names the NCCL a CUDA build ships (torchtune asks before allowing bf16)",
        package="torch",
    ),
    *_each(
        "torch.cuda.nvtx",
        NVTX_FUNCTIONS,
        by=_EMULATION,
        reason="NVTX ranges and marks do nothing without a GPU",
        package="torch",
    ),
    *_each(
        "torch.nn.Module",
        ("to", "cuda", "cpu"),
        by=_EMULATION,
        reason="a module moved to 'cuda' goes where the device mapping says (fake or CPU tensors)",
        package="torch",
    ),
    Patch(
        target="torch.nn.DataParallel.forward",
        by=_EMULATION,
        reason="DataParallel runs on the one emulated device",
        package="torch",
    ),
    Patch(
        target="torch.load",
        by=_EMULATION,
        reason="CUDA tensors in a checkpoint (or map_location='cuda') load to host memory and "
        "move as .to('cuda') would",
        package="torch",
    ),
    Patch(
        target="safetensors.torch.load_file",
        by=_EMULATION,
        reason="load_file(device='cuda') reads to host memory and moves as .to('cuda') would",
        package="safetensors",
    ),
    Patch(
        target="torch.amp.autocast_mode.autocast.__init__",
        by=_EMULATION,
        reason="autocast('cuda') runs as CPU autocast with CUDA's dtype over the emulated tensors",
        package="torch",
    ),
    *_each(
        "torch._subclasses.fake_tensor.FakeTensor",
        ("device", "is_cuda", "is_cpu", "get_device"),
        by=_EMULATION,
        reason="the trace's fake CPU tensors report the emulated CUDA device to the program",
        package="torch",
        note="on the CUDA target (is_cuda, is_cpu, get_device: where the mapping reports CUDA)",
    ),
    Patch(
        target="torch.Tensor._make_wrapper_subclass",
        by=_EMULATION,
        reason="a tensor subclass wrapping emulated tensors is made on the CPU where it names "
        "CUDA (torchao's NF4Tensor)",
        package="torch",
        note="set on torch.Tensor, ahead of torch._C.TensorBase's",
    ),
    Patch(
        target="torch.utils._device.DeviceContext.__init__",
        by=_EMULATION,
        reason="where the program enters `with torch.device(...)` on the CPU is recorded for the "
        "notes",
        package="torch",
    ),
    Patch(
        target="torch.autograd.function.BackwardCFunction.apply",
        by=_EMULATION,
        reason="a custom autograd.Function's backward runs under the emulation's device mode",
        package="torch",
    ),
    Patch(
        target="torch.autograd.graph.saved_tensors_hooks.__init__",
        by=_EMULATION,
        reason="saved-tensor hooks run under the emulation's device mode",
        package="torch",
    ),
    *_environment(
        ("HF_DEACTIVATE_ASYNC_LOAD",),
        by=_EMULATION,
        reason="transformers loads weights on this thread, where the emulation's thread-local "
        "mode sees them",
        package="transformers",
        resolves=_SYNCHRONOUS,
    ),
    Patch(
        target="torch.optim.optimizer._default_to_fused_or_foreach",
        by=_EMULATION,
        reason="torch.optim picks its implementation as on CUDA tensors (foreach), not the CPU's "
        "for-loop",
        package="torch",
        note="in every imported torch.optim module that binds the name (adam, adamw, sgd, ...)",
    ),
    Patch(
        target="aten::<CUDA autocast operators> (AutocastCPU)",
        by="trace/emulation/autocast_cuda.py",
        reason="CPU autocast casts with CUDA's operator lists while the CUDA policy is active",
        package="torch",
        kind="kernel",
        resolves="torch._C.DispatchKey.AutocastCPU",
        note="every operator of autocast_cuda.py's lists, and CPU autocast's own others passed "
        "through",
    ),
    Patch(
        target="torch.clear_autocast_cache",
        by="trace/emulation/autocast_cuda.py",
        reason="the emulated autocast's weight cache is cleared when torch.autocast clears its own",
        package="torch",
    ),
    Patch(
        target="aten::scaled_dot_product_attention (AutogradCPU)",
        by="trace/emulation/sdpa_cuda.py",
        reason="attention on CPU tensors picks and runs the backend a GPU of the compute "
        "capability would",
        package="torch",
        kind="kernel",
        resolves="torch.ops.aten.scaled_dot_product_attention",
    ),
    Patch(
        target="torch.nn.functional.dropout",
        by="trace/emulation/cuda_policy.py",
        reason="dropout as on a CUDA tensor: the fused kernel's bool mask",
        package="torch",
    ),
    *_each(
        "bitsandbytes.functional",
        ("get_paged", "fill"),
        by="trace/emulation/paged_states.py",
        reason="paged optimizer states (CUDA unified memory) are made as fake tensors outside "
        "the allocator, and counted",
        package="bitsandbytes",
        note="when bitsandbytes.functional is imported",
    ),
    Patch(
        target="triton.runtime.jit.JITFunction.run",
        by="trace/emulation/triton_launches.py",
        reason="a Triton launch on fake tensors is skipped and counted (it allocates nothing from "
        "PyTorch's allocator)",
        package="triton",
        note="when triton.runtime.jit is imported",
    ),
    Patch(
        target="triton.runtime.autotuner.Autotuner._bench",
        by="trace/emulation/triton_launches.py",
        reason="an autotuner on fake tensors times nothing and takes its first configuration",
        package="triton",
        note="when triton.runtime.autotuner is imported",
    ),
    # -- trace/program: the user's program under the trace ------------------------------------
    *_each(
        "torch.autograd",
        ("backward", "grad"),
        by="trace/program/program_trace.py",
        reason="the program's backward is seen where it starts, for the step's phases",
        package="torch",
    ),
    *_each(
        "sys",
        ("stdout", "stderr"),
        by="trace/program/program_blocks.py",
        reason="the program's output is shown once across its shallow and full runs (passed, "
        "held or dropped)",
        package=PYTHON,
    ),
    # -- inputs: readers of the user's program ------------------------------------------------
    Patch(
        target="torch.nn.parameter._ParameterMeta.__instancecheck__",
        by="inputs/bnb_weights.py",
        reason="isinstance(weight, Params4bit) holds for an emulated quantized weight, as for "
        "the GPU run's",
        package="torch",
    ),
    Patch(
        target="bitsandbytes.nn.modules.has_avx512bf16",
        by="inputs/bnb_weights.py",
        reason="Linear4bit never takes its CPU inference layout on the CUDA target",
        package="bitsandbytes",
    ),
    *_each(
        "bitsandbytes.nn.modules.Params4bit",
        ("__new__", "to", "_quantize"),
        by="inputs/bnb_weights.py",
        reason="4-bit weights of emulated tensors are made and quantized on the emulated GPU "
        "with bitsandbytes' own code",
        package="bitsandbytes",
    ),
    *_each(
        "bitsandbytes.nn.modules.Int8Params",
        ("__new__", "to", "_quantize"),
        by="inputs/bnb_weights.py",
        reason="8-bit weights of emulated tensors are made and quantized on the emulated GPU "
        "with bitsandbytes' own code",
        package="bitsandbytes",
    ),
    Patch(
        target="bitsandbytes.functional.name2qmap",
        by="inputs/bnb_weights.py",
        reason="bitsandbytes' cache of its 8-bit code starts empty, as in a new process, and is "
        "given back after",
        package="bitsandbytes",
        kind="contents",
    ),
    Patch(
        target=f"{LIGHTNING_BNB}._import_bitsandbytes",
        by="inputs/bnb_weights.py",
        reason="Lightning's 4- and 8-bit layers, defined when it imports bitsandbytes, are "
        "patched as they are made",
        package="lightning",
    ),
    *_each(
        LIGHTNING_BNB,
        ("_Linear4bit.__init__", "_Linear4bit.quantize_"),
        by="inputs/bnb_weights.py",
        reason="Lightning's layer quantizes at construction on the emulated GPU, as on CUDA",
        package="lightning",
        resolves=f"{LIGHTNING_BNB}._import_bitsandbytes",
        note="the class is a global of the module once _import_bitsandbytes has run",
    ),
    *_each(
        LIGHTNING_BNB,
        ("_Linear8bitLt.__init__", "_Linear8bitLt.quantize_"),
        by="inputs/bnb_weights.py",
        reason="Lightning's layer quantizes at construction on the emulated GPU, as on CUDA",
        package="lightning",
        resolves=f"{LIGHTNING_BNB}._import_bitsandbytes",
        note="the class is a global of the module once _import_bitsandbytes has run",
    ),
    Patch(
        target=f"{LIGHTNING_BNB}.BitsandbytesPrecision.__init__",
        by="inputs/bnb_weights.py",
        reason="the real CPU run refuses Lightning's bitsandbytes plugin in one line (it "
        "quantizes only CUDA tensors)",
        package="lightning",
    ),
    Patch(
        target="torch.load",
        by="inputs/checkpoint_shapes.py",
        reason="a checkpoint is mapped (or read without its data), never read: shapes only",
        package="torch",
        everywhere=True,
    ),
    *_each(
        "safetensors",
        ("safe_open", "torch.load_file"),
        by="inputs/checkpoint_shapes.py",
        reason="a safetensors file's header is read and its tensors made uninitialised: shapes "
        "only",
        package="safetensors",
        everywhere=True,
    ),
    Patch(
        target="lightning.fabric.utilities.load._lazy_load",
        by="inputs/checkpoint_shapes.py",
        reason="Lightning's lazy loader (LitGPT's checkpoints) maps the file instead of reading it",
        package="lightning",
        everywhere=True,
    ),
    Patch(
        target="lightning_fabric.utilities.load._lazy_load",
        by="inputs/checkpoint_shapes.py",
        reason="the standalone lightning_fabric's lazy loader, as lightning's",
        package="lightning-fabric",
        everywhere=True,
    ),
    Patch(
        target="transformers.modeling_utils.PreTrainedModel.from_pretrained",
        by="inputs/checkpoint_shapes.py",
        reason="a local folder with only config.json builds the model from its config instead "
        "of raising",
        package="transformers",
    ),
    *_environment(
        ("HF_DEACTIVATE_ASYNC_LOAD",),
        by="inputs/checkpoint_shapes.py",
        reason="transformers loads weights on this thread (shapes need no parallel reads)",
        package="transformers",
        resolves=_SYNCHRONOUS,
    ),
    Patch(
        target="torch.load",
        by="inputs/saved_objects.py",
        reason="a load of a place the program saved to in this run answers from what it saved",
        package="torch",
    ),
    *_each(
        "torch",
        ("save", "serialization.save"),
        by="inputs/program.py",
        reason="checkpoint saves write nothing; where each was asked is noted",
        package="torch",
        everywhere=True,
    ),
    *_each(
        "safetensors.torch",
        ("save_file", "save", "save_model"),
        by="inputs/program.py",
        reason="checkpoint saves write nothing; where each was asked is noted",
        package="safetensors",
        everywhere=True,
    ),
    Patch(
        target="transformers.modeling_utils.safe_save_file",
        by="inputs/program.py",
        reason="checkpoint saves write nothing; where each was asked is noted",
        package="transformers",
        everywhere=True,
        note="only where transformers is imported already",
    ),
    Patch(
        target="transformers.modeling_utils.PreTrainedModel.save_pretrained",
        by="inputs/program.py",
        reason="checkpoint saves write nothing; where each was asked is noted",
        package="transformers",
        note="only where transformers is imported already",
    ),
    Patch(
        target="runpy.run_path",
        by="inputs/program.py",
        reason="a file the program runs with runpy is the program's (its frames, its errors)",
        package=PYTHON,
    ),
    Patch(
        target="sys.argv",
        by="inputs/program.py",
        reason="the program sees its own arguments (sys.path's first entry too, as python sets it)",
        package=PYTHON,
    ),
    Patch(
        target="subprocess.Popen.__init__",
        by="inputs/program.py",
        reason="the Python processes the program starts (a launcher's) are noted: vramledger does "
        "not follow them",
        package=PYTHON,
    ),
    Patch(
        target="importlib.machinery.SourceFileLoader.exec_module",
        by="inputs/import_hooks.py",
        reason="a library the program imports late is patched once its module has executed",
        package=PYTHON,
        kind="instance",
        note="on the loader of the awaited module only",
    ),
    *_environment(
        ("HF_HUB_OFFLINE",),
        by="inputs/offline_hub.py",
        reason="the Hub is offline while a program runs: nothing is downloaded",
        package="huggingface-hub",
        resolves="huggingface_hub.constants.HF_HUB_OFFLINE",
    ),
    Patch(
        target="huggingface_hub.constants.HF_HUB_OFFLINE",
        by="inputs/offline_hub.py",
        reason="the Hub is offline also where huggingface_hub read the variable at import",
        package="huggingface-hub",
    ),
    *_each(
        "huggingface_hub",
        ("hf_hub_download", "snapshot_download"),
        by="inputs/offline_hub.py",
        reason="the downloads the offline Hub refuses are recorded for the error's hint",
        package="huggingface-hub",
        everywhere=True,
    ),
    *_each(
        "huggingface_hub.HfApi",
        ("hf_hub_download", "snapshot_download"),
        by="inputs/offline_hub.py",
        reason="the downloads the offline Hub refuses are recorded for the error's hint",
        package="huggingface-hub",
    ),
    *_each(
        "torch.distributed",
        ("init_process_group", "distributed_c10d.init_process_group"),
        by="inputs/torchrun_env.py",
        reason="a traced rank's init_process_group makes the rank's fake process group",
        package="torch",
    ),
    *_environment(
        TORCHRUN_VARIABLES,
        by="inputs/torchrun_env.py",
        reason="each traced rank of a program sees the variables torchrun would set for it",
        package="torch",
        resolves=ENV_RENDEZVOUS,
    ),
    *_environment(
        ("TRANSFORMERS_VERBOSITY",),
        by="inputs/chatter.py",
        reason="transformers' advisories stay off the terminal during a Python API call",
        package="transformers",
        resolves=TRANSFORMERS_READERS["TRANSFORMERS_VERBOSITY"],
    ),
    # -- parallel: the engines ----------------------------------------------------------------
    Patch(
        target=f"{DEEPSPEED_ENGINE}._configure_optimizer",
        by="parallel/program_deepspeed.py",
        reason="each engine a program builds is told to the trace: its ZeRO stage and its "
        "optimizer's buffers",
        package="deepspeed",
    ),
    Patch(
        target="deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
        ".initialize_optimizer_states",
        by="parallel/program_deepspeed.py",
        reason="its fp32 copies are tagged as master weights before its first step",
        package="deepspeed",
    ),
    *_each(
        "torch.Tensor",
        ("register_hook", "register_post_accumulate_grad_hook"),
        by="parallel/program_deepspeed.py",
        reason="a hook registered under the emulation runs under it (DeepSpeed's reduce bucket "
        "is made on the emulated GPU)",
        package="torch",
    ),
    *_each(
        "deepspeed.ops.adam.fused_adam",
        ("FusedAdamBuilder", "FusedAdam.__init__"),
        by="parallel/program_deepspeed.py",
        reason="FusedAdam's CUDA kernel is stood in for (in place, allocating nothing); its "
        "overflow flag is made on the device",
        package="deepspeed",
    ),
    *_each(
        "deepspeed.runtime.zero.utils",
        ("assert_lst_len_same_as_other_ranks", "get_lst_from_rank0"),
        by="parallel/deepspeed_zero3.py",
        reason="ZeRO-3's rank-0 list checks answer with the rank's own list (a fake process "
        "group carries no values)",
        package="deepspeed",
    ),
    Patch(
        target="deepspeed.runtime.zero.partitioned_param_coordinator"
        ".PartitionedParameterCoordinator.fetch_sub_module",
        by="parallel/deepspeed_zero3.py",
        reason="ZeRO-3's gathered parameters are tagged as all-gather buffers",
        package="deepspeed",
    ),
    *_each(
        DEEPSPEED_ZERO,
        (
            "reduce_gradients",
            "independent_gradient_partition_epilogue",
            "setup_buckets",
            "copy_grads_in_partition",
            "_optimizer_step",
        ),
        by="parallel/deepspeed_engine.py",
        reason="ZeRO-1/2's buffers are tagged at the moment DeepSpeed makes them (the methods run "
        "unchanged)",
        package="deepspeed",
        kind="instance",
        note="on the traced engine's optimizer",
    ),
    *_each(
        DEEPSPEED_ENGINE,
        ("allreduce_bucket", "buffered_allreduce_fallback"),
        by="parallel/deepspeed_engine.py",
        reason="stage 0's gradient buckets are tagged as DeepSpeed makes them",
        package="deepspeed",
        kind="instance",
        note="on the traced engine",
    ),
    Patch(
        target="deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator.create_op_builder",
        by="parallel/deepspeed_runtime.py",
        reason="the CPU accelerator's shared-memory collectives are not compiled (no training "
        "step uses them)",
        package="deepspeed",
        kind="instance",
        note="on the CPU accelerator vramledger makes, and on DeepSpeed's own in a real run",
    ),
    *_each(
        CPU_ACCELERATOR,
        ("available_memory", "is_fp16_supported", "device_name", "current_device_name"),
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed's CPU accelerator stands for a GPU: unbounded free memory, fp16, the "
        "emulated device's name",
        package="deepspeed",
        kind="instance",
        note="on the CPU accelerator vramledger makes (a fake run; the device name under the "
        "CUDA emulation)",
    ),
    *_each(
        "deepspeed.runtime.torch_autocast",
        ("TORCH_AUTOCAST_INITIALIZED", "TORCH_AUTOCAST_DTYPE"),
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed's cached autocast settings are fresh for each run in the process",
        package="deepspeed",
    ),
    Patch(
        target="deepspeed.accelerator.real_accelerator.ds_accelerator",
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed uses the accelerator vramledger gives it for the run",
        package="deepspeed",
    ),
    Patch(
        target="deepspeed.comm.comm.cdb",
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed's communication backend is made afresh over the run's process group",
        package="deepspeed",
    ),
    *_each(
        "deepspeed.utils.groups",
        ("_*GROUP*", "mpu", "mesh_device"),
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed's cached process groups are empty for each run in the process",
        package="deepspeed",
        note="every upper-case _..GROUP.. global that is not callable",
    ),
    *_environment(
        ("LOCAL_RANK",),
        by="parallel/deepspeed_runtime.py",
        reason="DeepSpeed's engine requires it (torchrun sets it): 0 for the one traced rank",
        package="deepspeed",
        resolves=f"{DEEPSPEED_ENGINE}._configure_with_arguments",
    ),
    *_each(
        "torch.distributed.tensor",
        ("_random.is_rng_supported_mesh", "_dispatch.is_rng_supported_mesh"),
        by="parallel/dtensor_rng.py",
        reason="DTensor's random operators on a 'cuda' mesh of the emulated GPU draw as on a CPU "
        "mesh, with no RNG tracker",
        package="torch",
    ),
    Patch(
        target="torch.distributed.tensor._api.is_rng_supported_mesh",
        by="parallel/dtensor_rng.py",
        reason="as _random's, where _api imports the name",
        package="torch",
        required=False,
        note="torch 2.13's _api does not define it; set anyway, and removed after",
    ),
    Patch(
        target="transformers.distributed.expert_parallel.all_to_all_single",
        by="parallel/experts.py",
        reason="the all-to-all of token counts is answered as every rank of the group would "
        "send them (a fake group carries no values)",
        package="transformers",
    ),
    Patch(
        target="sys.excepthook",
        by="parallel/fake_group.py",
        reason="put back after a fake world: init_process_group wraps it to prefix '[rankN]:'",
        package=PYTHON,
    ),
    Patch(
        target=f"{FSDP2}._fsdp_param._chunk_with_empty",
        by="parallel/fsdp_chunks.py",
        reason="FSDP2's chunks of a fake parameter are made only when read",
        package="torch",
    ),
    *_each(
        FSDP2,
        ("_fsdp_init._get_post_forward_mesh_info", "_fully_shard._get_post_forward_mesh_info"),
        by="parallel/fsdp_units.py",
        reason="an integer reshard_after_forward's mesh is built outside the trace's fake mode, "
        "as on a real rank",
        package="torch",
    ),
    Patch(
        target="torch.distributed.device_mesh.DeviceMesh.__init__",
        by="parallel/mesh.py",
        reason="meshes (FSDP2 over tensor parallelism) are built outside the trace's modes, as "
        "on a real rank",
        package="torch",
    ),
    Patch(
        target="torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p",
        by="parallel/pipeline_rank.py",
        reason="every stage's warm-up vote is STATIC (a fake group delivers no values to vote on)",
        package="torch",
        kind="instance",
        note="on the fake rank's schedule",
    ),
    *_each(
        "torch.distributed.pipelining.stage._PipelineStageBase",
        ("forward_one_chunk", "backward_one_chunk"),
        by="parallel/pipeline_rank.py",
        reason="each micro-batch's phase is told to the observer, and a stage's output shape "
        "checked",
        package="torch",
        kind="instance",
        note="on the rank's stages",
    ),
    Patch(
        target="torch.distributed.pipelining.schedules._batch_p2p",
        by="parallel/pipeline_step.py",
        reason="send and receive works hold their tensors until dropped, as a real process "
        "group's do",
        package="torch",
    ),
    Patch(
        target="torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p",
        by="parallel/program_pipeline.py",
        reason="a program's stages vote as all its ranks would (the ranks traced one after "
        "another)",
        package="torch",
    ),
    *_each(
        PIPELINE_STAGE,
        ("_send_meta", "_recv_meta", "_prepare_forward_infra", "_prepare_backward_infra"),
        by="parallel/program_pipeline.py",
        reason="shapes pass between a program's stages traced one rank after another; their "
        "receive buffers are tagged",
        package="torch",
    ),
    *_each(
        "torch.distributed.tensor.parallel.style",
        (f"{style}._apply" for style in PARALLEL_STYLES),
        by="parallel/program_tp.py",
        reason="the styles the program's parallelize_module applies are noted, and their "
        "collectives' outputs counted",
        package="torch",
        note="also every other ParallelStyle subclass defining _apply (torchtitan's, the "
        "program's)",
    ),
    Patch(
        target="torch.nn.Module.register_parameter",
        by="parallel/program_tp.py",
        reason="each parameter tensor parallelism replaces by a DTensor is told to the trace",
        package="torch",
    ),
    Patch(
        target=f"{FSDP2}._fsdp_param.FSDPParam._init_sharded_param",
        by="parallel/program_world.py",
        reason="each parameter FSDP2 replaces by its shard is told to the trace",
        package="torch",
    ),
    *_each(
        "torch.distributed",
        (
            "fsdp._fully_shard._fsdp_init._get_device_from_mesh",
            "fsdp._fully_shard._fully_shard._get_device_from_mesh",
            "_composable.replicate_with_fsdp._get_device_from_mesh",
        ),
        by="parallel/program_world.py",
        reason="FSDP2 on a CPU mesh puts its buffers on the emulated GPU",
        package="torch",
    ),
    *_each(
        DDP,
        ("__init__", "forward"),
        by="parallel/program_world.py",
        reason="DDP without its C++ reducer (which cannot run on fake tensors), with DDP's own "
        "gradient buckets",
        package="torch",
    ),
    # -- measure: real runs -------------------------------------------------------------------
    *_each(
        "torch.distributed",
        ("destroy_process_group", "distributed_c10d.destroy_process_group"),
        by="measure/program.py",
        reason="the program's destroy_process_group() leaves the harness's group, which the "
        "harness shuts down",
        package="torch",
    ),
    Patch(
        target=f"{DDP}.__init__",
        by="measure/program.py",
        reason="DDP(model, device_ids=[rank]) of a CPU model (its 'cuda' is the CPU here) drops "
        "the device ids",
        package="torch",
    ),
    *_environment(
        ("LOCAL_RANK",),
        by="measure/deepspeed.py",
        reason="DeepSpeed's engine requires it: 0 for a run of one process not launched by "
        "torchrun",
        package="deepspeed",
        resolves=f"{DEEPSPEED_ENGINE}._configure_with_arguments",
    ),
    *_environment(
        ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"),
        by="measure/local.py",
        reason="each local gloo rank's env:// rendezvous",
        package="torch",
        resolves=ENV_RENDEZVOUS,
    ),
    # -- the command line ---------------------------------------------------------------------
    *(
        Patch(
            target=f"os.environ[{name!r}]",
            by="cli/__init__.py",
            reason="transformers' advisories stay off the terminal (unless set)",
            package="transformers",
            kind="environment",
            resolves=reader,
        )
        for name, reader in TRANSFORMERS_READERS.items()
    ),
    *_environment(
        ("HF_HUB_OFFLINE",),
        by="cli/__init__.py",
        reason="the command line never downloads (unless set)",
        package="huggingface-hub",
        resolves="huggingface_hub.constants.HF_HUB_OFFLINE",
    ),
    *(
        Patch(
            target=f"os.environ[{name!r}]",
            by="cli/serve/worker.py",
            reason="transformers' advisories stay out of the page's workers' logs (unless set)",
            package="transformers",
            kind="environment",
            resolves=reader,
        )
        for name, reader in TRANSFORMERS_READERS.items()
    ),
    *_environment(
        ("HF_HUB_OFFLINE",),
        by="cli/serve/worker.py",
        reason="the page's workers never download (unless set)",
        package="huggingface-hub",
        resolves="huggingface_hub.constants.HF_HUB_OFFLINE",
    ),
    Patch(
        target="sys.stdout",
        by="answer_cache.py",
        reason="what a cacheable command writes is kept (a tee) for the answer cache",
        package=PYTHON,
    ),
)
"""Every patch vramledger makes (module docstring), grouped by floor."""
