"""FSDP2 units: which modules ``fully_shard`` is applied to, with which options, in which order.

The one place both runs wrap a model — the estimate's fake-process-group run
(``engines.RankEngine.wrap``) and the real run under torchrun (``real.wrap_real``) — so a
prediction and its measurement shard alike.

==========================  ===================================================================
the spec says               units, in the order ``fully_shard`` is applied
==========================  ===================================================================
nothing                     each block of the traced block stack (else of the largest stack of
                            identical blocks), then the root
``shard_modules``           every submodule that is an instance of a class of one of these
                            names, children before parents (post-order), then the root
``shard_min_params``        every submodule but the root holding more than N parameters (its
                            submodules' included), children before parents, then the root
``accelerate_config``       accelerate's ``fsdp2_prepare_model`` (accelerate 1.15): the wrap
                            policy's units (the two above, bottom-up), then the input
                            embedding when it is not tied to the output one, then the final
                            norm and the output embedding (and a tied input embedding) as one
                            group that is not resharded after forward, then the root; modules
                            already wrapped are left out of the later groups
==========================  ===================================================================

FSDP2 groups into one unit the parameters of ``module.parameters()`` that no earlier call
took, so children must be wrapped before their parents. ``reshard_after_forward`` (the spec's;
None is FSDP2's default, True) goes to every unit; the root keeps FSDP2's default (None: False
for the root, which backward needs first), as accelerate does. A ModuleList or ModuleDict
without a forward of its own is refused, as FSDP2 refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramledger.inputs.errors import InputError
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.fsdp_chunks import lazy_chunks
from vramledger.trace.core.blocks import NotExtensible, find_block_stack


@dataclass(frozen=True)
class ShardUnit:
    modules: tuple[nn.Module, ...]
    """One module, or (accelerate's tail) several grouped into one FSDP2 unit."""
    reshard_after_forward: bool | int | None = None
    """None: FSDP2's default."""


def post_order(model: nn.Module) -> Iterator[nn.Module]:
    """Every submodule once, children before parents, in definition order (the order of
    accelerate's ``get_module_children_bottom_up``); the root last."""
    seen: set[int] = set()

    def walk(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from walk(child)
        yield module

    seen.add(id(model))
    yield from walk(model)


def classes_named(model: nn.Module, names: Sequence[str]) -> tuple[type, ...]:
    """The module classes of these names found in ``model`` (in each module's class hierarchy,
    so a checkpointed ``Linear`` is still a ``Linear``); an error names any that is missing."""
    found: dict[str, type] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in names and issubclass(cls, nn.Module):
                found.setdefault(cls.__name__, cls)
    missing = [n for n in names if n not in found]
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise InputError(
            f"no submodule of class {', '.join(missing)} in {type(model).__name__}",
            hint=f"classes present: {', '.join(present[:20])}",
        )
    return tuple(found.values())


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def policy_units(model: nn.Module, spec: TrainingSpec) -> list[nn.Module] | None:
    """The units a named policy picks (the root excluded), or None when none is named."""
    if spec.shard_modules:
        classes = classes_named(model, spec.shard_modules)
        return [m for m in post_order(model) if m is not model and isinstance(m, classes)]
    if spec.shard_min_params is not None:
        n = spec.shard_min_params
        return [m for m in post_order(model) if m is not model and _num_params(m) > n]
    return None


def shard_units(
    model: nn.Module, spec: TrainingSpec, blocks: Sequence[nn.Module] = ()
) -> tuple[list[ShardUnit], str]:
    """The units ``fully_shard`` is applied to before the root, and a few words on them."""
    reshard = spec.reshard_after_forward
    picked = policy_units(model, spec)
    if spec.accelerate_config is not None:
        return _accelerate_units(model, picked or [], reshard)
    if picked is None:
        if not blocks:
            stack = find_block_stack(model, min_blocks=1)
            blocks = list(model.get_submodule(stack.fqn)) if stack is not None else []
        units = [ShardUnit((b,), reshard) for b in blocks]
        return units, "each block of the block stack and the root" if units else "the root"
    if not picked:
        raise InputError(
            f"--shard-min-params {spec.shard_min_params}: no submodule of "
            f"{type(model).__name__} has more parameters",
            hint="give a smaller number, or name the units with --shard-modules",
        )
    what = ", ".join(spec.shard_modules) or f"more than {spec.shard_min_params:,} parameters"
    units = [ShardUnit((m,), reshard) for m in picked]
    return units, f"every module of {what} and the root"


def _accelerate_units(
    model: nn.Module, picked: list[nn.Module], reshard: bool | int | None
) -> tuple[list[ShardUnit], str]:
    """accelerate 1.15 ``fsdp2_prepare_model``, after its policy's units: the input embedding
    alone unless tied to the output embedding, then ``[final norm, (input embedding if tied),
    output embedding]`` as one group with ``reshard_after_forward=False``."""
    units = [ShardUnit((m,), reshard) for m in picked]
    taken = {id(m) for m in picked}
    inp = _call_or_none(model, "get_input_embeddings")
    out = _call_or_none(model, "get_output_embeddings")
    inp_weight = getattr(inp, "weight", None)
    tied = inp_weight is not None and inp_weight is getattr(out, "weight", None)
    if inp is not None and not tied and id(inp) not in taken:
        units.append(ShardUnit((inp,), reshard))
        taken.add(id(inp))
    tail_modules = (final_norm(model), inp, out) if tied else (final_norm(model), out)
    tail = tuple(m for m in tail_modules if m is not None and id(m) not in taken)
    if tail:
        units.append(ShardUnit(tail, False))
    groups = ["the wrap policy's units"] if picked else []
    groups += ["the input embedding"] if inp is not None and not tied else []
    groups += [f"{len(tail)} final modules as one group kept after forward"] if tail else []
    return units, f"accelerate's fsdp2_prepare_model units: {', '.join([*groups, 'the root'])}"


def _call_or_none(model: nn.Module, name: str) -> nn.Module | None:
    get = getattr(model, name, None)
    if get is None:
        return None
    try:
        return get()
    except NotImplementedError:  # transformers' default for models without that embedding
        return None


def final_norm(model: nn.Module) -> nn.Module | None:
    """accelerate's ``_find_final_norm``: the last direct child of the base model whose class
    name contains ``Norm``."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, nn.Module):
        return None
    found = None
    for _, module in base.named_children():
        if "Norm" in type(module).__name__:
            found = module
    return found


def check_units_are_blocks(units: list[ShardUnit], blocks: Sequence[nn.Module]) -> None:
    """A trace of a few blocks extends to all of them only if each block is a unit of its own
    and no other unit holds a block or lies inside one; else ``NotExtensible`` (every block is
    then traced)."""
    if not blocks:
        return
    block_ids = {id(b) for b in blocks}
    inside = {id(m) for b in blocks for m in b.modules() if m is not b}
    singles = {id(u.modules[0]) for u in units if len(u.modules) == 1}
    if not block_ids <= singles:
        raise NotExtensible("the FSDP units are not the blocks")
    for unit in units:
        for module in unit.modules:
            if id(module) in block_ids:
                if len(unit.modules) > 1:
                    raise NotExtensible("an FSDP unit groups a block with other modules")
                continue
            if id(module) in inside or any(id(m) in block_ids for m in module.modules()):
                raise NotExtensible("an FSDP unit lies inside a block or holds blocks")


def _check_wrappable(model: nn.Module, units: list[ShardUnit], spec: TrainingSpec) -> None:
    """FSDP2 refuses a ModuleList or ModuleDict that has no forward of its own (its hooks would
    never run); say which unit it is, in the options' terms."""
    names = {id(m): n for n, m in model.named_modules()}
    for unit in units:
        for module in unit.modules:
            if (
                isinstance(module, (nn.ModuleList, nn.ModuleDict))
                and type(module).forward is nn.Module.forward
            ):
                n = _num_params(module)
                by_size = spec.shard_min_params is not None
                raise InputError(
                    f"FSDP2 cannot shard {names[id(module)]} ({type(module).__name__}, a container "
                    f"without forward, {n:,} parameters)"
                    + (", and the size-based policy picks it" if by_size else ""),
                    hint=f"a minimum of at least {n:,} parameters leaves it out; accelerate's "
                    "SIZE_BASED_WRAP fails the same way"
                    if by_size
                    else "name the modules inside it",
                )


def mixed_precision_policy(spec: TrainingSpec, precision_name: str) -> Any:
    """FSDP2's MixedPrecisionPolicy for the precision: half-precision compute with fp32
    reduction; from an accelerate config, accelerate's own (``set_mixed_precision``: parameters,
    reduction and outputs all in the half dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision_name not in ("bf16-master", "fp16-master"):
        return MixedPrecisionPolicy()
    half = torch.bfloat16 if precision_name == "bf16-master" else torch.float16
    if spec.accelerate_config is not None:
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half, output_dtype=half)
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)


def apply_fully_shard(
    model: nn.Module,
    spec: TrainingSpec,
    mesh: Any,
    precision_name: str,
    blocks: Sequence[nn.Module] = (),
) -> str:
    """``fully_shard`` on each unit and then the root; returns what was wrapped, in words.
    ``blocks``: the traced block stack (a trace of a few blocks); named units that are not the
    blocks raise ``NotExtensible`` before anything is wrapped."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units, words = shard_units(model, spec, blocks)
    _check_wrappable(model, units, spec)
    if spec.shard_modules or spec.shard_min_params is not None or spec.accelerate_config:
        check_units_are_blocks(units, blocks)
    mp = mixed_precision_policy(spec, precision_name)
    with _post_forward_mesh_outside_fake_mode(), lazy_chunks():
        for unit in units:
            modules = [m for m in unit.modules if not isinstance(m, FSDPModule)]
            if not modules:
                continue
            kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
            if unit.reshard_after_forward is not None:
                kwargs["reshard_after_forward"] = unit.reshard_after_forward
            fully_shard(modules[0] if len(modules) == 1 else modules, **kwargs)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if spec.reshard_after_forward is not None:
        words += f", reshard_after_forward={spec.reshard_after_forward} on the units"
    return words


@contextlib.contextmanager
def _post_forward_mesh_outside_fake_mode() -> Iterator[None]:
    """An integer ``reshard_after_forward`` makes FSDP2 build a smaller DeviceMesh from the
    mesh's rank tensor (``_get_post_forward_mesh_info``), a real tensor that a trace's fake
    mode refuses; it is built outside the trace's modes, as on a real rank (a real run has no
    such mode, and nothing changes there)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    from torch.utils._python_dispatch import _disable_current_modes

    original = _fsdp_init._get_post_forward_mesh_info

    def outside_the_trace(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(*args, **kwargs)

    modules = (_fsdp_init, _fully_shard)
    for module in modules:
        module._get_post_forward_mesh_info = outside_the_trace
    try:
        yield
    finally:
        for module in modules:
            module._get_post_forward_mesh_info = original
