"""From a TrainingSpec to the pieces a run needs, shared by tracing and measuring: the model
built on a device (checkpointed and cast), the input maker, the loss, the precision and the
optimizer choice."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vramledger.inputs.adapters import (
    apply_lora,
    freeze,
    index_dependent_option,
    keep_trainable,
    logical_numel,
    parse_lora,
    prepare_for_kbit_training,
    quantize_linears,
    trainable_choice,
)
from vramledger.inputs.checkpointing import checkpoint_modules, enable_hf_checkpointing
from vramledger.inputs.config_depth import config_depth, shallow_config
from vramledger.inputs.errors import InputError, TraceError, VramledgerError
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.optimizers import OptimizerChoice, resolve_optimizer
from vramledger.inputs.precision import PrecisionPolicy, cast_model, dtype_name, precision_policy
from vramledger.inputs.sources import (
    BatchShape,
    Inputs,
    LossFn,
    ModelSource,
    resolve_inputs,
    resolve_loss,
    resolve_model,
)
from vramledger.inputs.spec import TrainingSpec


@dataclass(frozen=True, kw_only=True)
class Recipe:
    spec: TrainingSpec
    source: ModelSource
    make_inputs: Inputs
    loss_fn: LossFn
    precision: PrecisionPolicy
    optimizer: OptimizerChoice

    @property
    def shape(self) -> BatchShape:
        s = self.spec
        return BatchShape(batch_size=s.batch_size, seq_len=s.seq_len, image_size=s.image_size)

    def at_depth(self, blocks: int) -> Recipe:
        """This recipe with ``blocks`` of the model's layers (a Hugging Face config that says its
        depth): the one way every trace of a shallower model is made — the block extension's,
        a mesh's one-block shape check, a pipeline's parts. Every option reaches it, since the
        source rebuilds from its own build function (``ModelSource.with_config``) and
        :meth:`build_model` applies the rest."""
        config = self.source.config
        depth = config_depth(config)
        if depth is None:
            raise ValueError(f"{self.source.name} does not say its depth")
        return replace(self, source=self.source.with_config(shallow_config(config, blocks, depth)))

    def build_model(self, device: str | torch.device) -> nn.Module:
        """Build on ``device`` (meta for tracing), in train mode, with every model option of the
        spec: checkpointing, the precision's dtypes, quantized base weights, LoRA adapters and
        frozen parameters (the attention path and config are the source's)."""
        spec, source = self.spec, self.source
        with torch.device(device):
            if str(device) == "meta":
                with source.skip_init():
                    model = _build(source)
            else:
                model = _build(source)
        model.train()
        if spec.grad_checkpointing:
            # Hugging Face models, and Python code returning one (or a peft model around one)
            if source.supports_hf_checkpointing or getattr(
                model, "supports_gradient_checkpointing", False
            ):
                enable_hf_checkpointing(model)
            elif not spec.checkpoint_modules:
                raise InputError(
                    "--grad-checkpointing uses the Hugging Face switch, and this model is "
                    "Python code without it",
                    hint="name the blocks to checkpoint with --checkpoint-modules CLASSNAME",
                )
        if spec.checkpoint_modules:
            checkpoint_modules(model, spec.checkpoint_modules)
        cast_model(model, self.precision)
        if spec.quantize is not None:
            chosen = trainable_choice(model)
            quantize_linears(model, spec.quantize, self.compute_dtype, torch.device(device))
            prepare_for_kbit_training(model)
            if chosen is not None:
                keep_trainable(model, chosen)
        if spec.lora is not None:
            # On meta, peft makes the adapters there too: it would otherwise make and initialise
            # real CPU tensors and then move them to the base layer's device (most of a shallow
            # build's time on a 7B model).
            with torch.device(device) if str(device) == "meta" else contextlib.nullcontext():
                model = apply_lora(model, parse_lora(spec.lora))
        if spec.freeze:
            freeze(model, spec.freeze)
        if "seq_len" in self.make_inputs.uses:  # a default is checked only where it is used
            _check_positions(model, spec.seq_len)
        return model

    def index_dependent_option(self, model: nn.Module, stack: str, indices: range) -> str | None:
        """The model option (``--lora`` targets, ``--freeze`` patterns) that would make the
        blocks at ``indices`` of ``stack`` unlike each other, judged on ``model``, a shallow
        build of this recipe (``adapters.index_dependent_option``)."""
        spec = self.spec
        lora = parse_lora(spec.lora) if spec.lora is not None else None
        return index_dependent_option(model, stack, indices, tuple(spec.freeze), lora)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (what quantized weights are dequantized to)."""
        policy = self.precision
        if policy.param_dtype is not torch.float32:
            return policy.param_dtype
        return policy.autocast_dtype or torch.float32

    def make_batch(self, device: str | torch.device) -> Any:
        """The batch, made with the spec's seed (the same values in a trace and a real run),
        leaving the caller's random state as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.seed)
            return self.make_inputs(torch.device(device), self.shape)

    def dtype_note(self) -> str:
        """Which dtype the parameters are stored in, and why."""
        stored = dtype_name(self.precision.param_dtype)
        note = (
            f"--precision {self.spec.precision}: {self.precision.models}; parameters stored in "
            f"{stored}"
        )
        declared = self.source.declared_dtype
        if declared is not None:
            note += (
                f"; the config's declared dtype {declared} is how its checkpoint is stored, "
                "not the training precision"
            )
        return Note(Topic.INPUTS, note)


def resolve(spec: TrainingSpec) -> Recipe:
    """Resolve every name in the spec (model first, so its errors come first)."""
    source = resolve_model(spec.model, spec.task, spec.attn_implementation)
    return Recipe(
        spec=spec,
        source=source,
        make_inputs=resolve_inputs(spec.inputs, source),
        loss_fn=resolve_loss(spec.loss),
        precision=precision_policy(spec.precision),
        optimizer=resolve_optimizer(spec.optimizer, spec.optimizer_kwargs),
    )


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter counts; tied parameters once, quantized ones by the elements
    they stand for (as peft's ``print_trainable_parameters``)."""
    params = list(model.parameters())  # shared (tied) parameters appear once
    return (
        sum(logical_numel(p) for p in params),
        sum(p.numel() for p in params if p.requires_grad),
    )


def module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): (n or type(model).__name__) for n, m in model.named_modules()}


def _build(source: ModelSource) -> nn.Module:
    try:
        return source.build()
    except VramledgerError:
        raise
    except NotImplementedError as exc:  # e.g. Tensor.item() on meta tensors in __init__
        raise TraceError(
            f"building {source.name} on the meta device failed: {str(exc).splitlines()[0]}",
            hint="its __init__ reads tensor values; use `vramledger measure` to run it for real",
        ) from exc


def _check_positions(model: nn.Module, seq_len: int) -> None:
    """Learned position tables index out of range silently on fake tensors; refuse instead."""
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.Embedding)
            and ("position" in name or name.endswith("wpe"))
            and module.num_embeddings < seq_len
        ):
            raise InputError(
                f"seq-len {seq_len} exceeds the {module.num_embeddings} learned positions of {name}",
                hint=f"use --seq-len {module.num_embeddings} or less",
            )
