"""Tensor- and sequence-parallel plans: which module is split how, as the ``parallelize_plan``
of ``torch.distributed.tensor.parallel.parallelize_module``.

The default plan of a Hugging Face decoder is built from the model family's own plan
(transformers 5's ``model.tp_plan``: ``colwise``/``rowwise`` per projection,
``embedding_rowwise`` for the input embedding) and laid out as torchtitan's ``apply_tp`` lays
out a Llama (``torchtitan/models/llama3/infra/parallelize.py``):

==========================  ===================================================================
module                      style
==========================  ===================================================================
input embedding             ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``
                            (vocabulary split; the sum over ranks is reduce-scattered along the
                            sequence)
norms of each block,        ``SequenceParallel()`` (the sequence split; torchtitan's
the final norm              ``attention_norm``, ``ffn_norm``, ``norm``)
attention, MLP              ``PrepareModuleInput``: the hidden states gathered from
                            ``Shard(1)`` to ``Replicate()`` (all-gather along the sequence)
q/k/v, gate/up projections  ``ColwiseParallel()`` (the family plan's ``colwise``)
o, down projections         ``RowwiseParallel(output_layouts=Shard(1))`` (``rowwise``;
                            reduce-scatter back to the sequence split)
output embedding            ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                            use_local_output=False)`` (loss parallel: logits stay split over the
                            vocabulary; the loss runs under ``loss_parallel()``)
==========================  ===================================================================

The residual stream between blocks stays a DTensor sharded along the sequence
(``use_local_output=False``), so the model's own code sees global shapes (its position ids and
rotary tables span the whole sequence).

A user plan is ``--tp-plan FILE.py:FUNCTION``, called with the model and the tensor-parallel
mesh (``FUNCTION(model, tp_mesh)``, or ``FUNCTION(model)``) and returning the plan dict of
module name (fnmatch pattern) -> ``ParallelStyle``; whether it keeps the loss parallel is read
from its output embedding's style (``use_local_output=False`` with ``Shard(-1)``).
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from vramledger.inputs.errors import InputError
from vramledger.inputs.sources import load_callable

SEQUENCE_DIM = 1
"""The sequence dimension of a decoder's hidden states (batch, sequence, hidden)."""


@dataclass(frozen=True)
class TpPlan:
    styles: dict[str, Any]
    """Module name -> ParallelStyle, for ``parallelize_module``."""
    loss_parallel: bool
    """The logits stay split over the vocabulary: the loss must run under ``loss_parallel()``."""
    source: str
    """Where the plan comes from, in words."""


def tp_plan(model: nn.Module, tp_mesh: Any, user_plan: str | None) -> TpPlan:
    """The plan for ``model``: the user's (``FILE.py:FUNCTION``) or its family's."""
    if user_plan is not None:
        return _user_plan(model, tp_mesh, user_plan)
    family = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not family:
        raise InputError(
            f"{type(model).__name__} has no tensor-parallel plan (transformers' tp_plan)",
            hint="give one with --tp-plan FILE.py:FUNCTION returning {module name: ParallelStyle}",
        )
    return _decoder_plan(model, dict(family))


def _user_plan(model: nn.Module, tp_mesh: Any, path: str) -> TpPlan:
    fn = load_callable(path, "--tp-plan")
    takes_mesh = len(inspect.signature(fn).parameters) >= 2
    styles = fn(model, tp_mesh) if takes_mesh else fn(model)
    if not isinstance(styles, dict) or not styles:
        raise InputError(f"--tp-plan {path} returned {type(styles).__name__}, not a plan dict")
    return TpPlan(styles=styles, loss_parallel=_keeps_logits_split(model, styles), source=path)


def _keeps_logits_split(model: nn.Module, styles: dict[str, Any]) -> bool:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    out = _output_embedding_name(model)
    for pattern, style in styles.items():
        if out is not None and fnmatch.fnmatchcase(out, pattern):
            return (
                isinstance(style, ColwiseParallel)
                and not style.use_local_output
                and isinstance(style.output_layouts[0], Shard)
            )
    return False


def _output_embedding_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if get is not None else None
    if out is None:
        return None
    return next((n for n, m in model.named_modules() if m is out), None)


def _decoder_plan(model: nn.Module, family: dict[str, str]) -> TpPlan:
    """torchtitan's Llama layout on the family plan's projections (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    names = dict(model.named_modules())
    styles: dict[str, Any] = {}
    unsupported = sorted(
        f"{name} ({style})"
        for name, style in family.items()
        if style not in ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output")
    )
    if unsupported:
        raise InputError(
            f"the tensor-parallel plan of {type(model).__name__} has styles not modelled here: "
            + ", ".join(unsupported[:4]),
            hint="give a plan with --tp-plan FILE.py:FUNCTION",
        )
    parents: set[str] = set()
    for pattern, style in family.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            continue
        if style == "colwise":
            styles[pattern] = ColwiseParallel()
            parents.update(n.rpartition(".")[0] for n in matched)
        elif style == "rowwise":
            styles[pattern] = RowwiseParallel(
                output_layouts=Shard(SEQUENCE_DIM), use_local_output=False
            )
        elif style == "embedding_rowwise":
            styles[pattern] = RowwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(SEQUENCE_DIM),
                use_local_output=False,
            )
    out = _output_embedding_name(model)
    if out is not None:
        styles[out] = ColwiseParallel(
            input_layouts=Shard(SEQUENCE_DIM), output_layouts=Shard(-1), use_local_output=False
        )
    for parent in sorted(parents):
        styles[parent] = _gather_hidden_states(names[parent])
    for name in _residual_norms(model, parents):
        styles[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    return TpPlan(
        styles=styles,
        loss_parallel=out is not None,
        source=f"transformers' {type(model).__name__}.tp_plan laid out as torchtitan's apply_tp "
        "(sequence parallel norms, loss parallel)",
    )


def _gather_hidden_states(module: nn.Module) -> Any:
    """torchtitan's ``PrepareModuleInput`` before attention and MLP: the hidden states (the
    first parameter of ``forward``) gathered from the sequence split to every rank, whether they
    are passed by position (a Llama MLP) or by name (a Llama attention)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class PrepareFirstInput(PrepareModuleInput):
        def _prepare_input_fn(self, inputs: Any, device_mesh: Any) -> Any:
            if not inputs:
                return inputs
            first = self._prepare_input_arg(
                inputs[0], device_mesh, Shard(SEQUENCE_DIM), Replicate()
            )
            return (first, *inputs[1:])

    first = next(iter(inspect.signature(module.forward).parameters))
    return PrepareFirstInput(
        input_kwarg_layouts={first: Shard(SEQUENCE_DIM)},
        desired_input_kwarg_layouts={first: Replicate()},
        use_local_output=True,
    )


def _residual_norms(model: nn.Module, parents: set[str]) -> list[str]:
    """Norms applied to the residual stream: the children whose class name contains ``Norm`` of
    each module holding an attention or MLP (the blocks), and of the base model (its final
    norm)."""
    names = dict(model.named_modules())
    holders = {p.rpartition(".")[0] for p in parents}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and prefix in names:
        holders.add(prefix)
    out = []
    for holder in sorted(holders):
        for child, module in names[holder].named_children():
            if "Norm" in type(module).__name__:
                out.append(f"{holder}.{child}" if holder else child)
    return out


def matched_modules(model: nn.Module, styles: dict[str, Any]) -> dict[str, Any]:
    """Module name -> style for every module a plan's patterns match."""
    out = {}
    for name, _ in model.named_modules():
        for pattern, style in styles.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
    return out
