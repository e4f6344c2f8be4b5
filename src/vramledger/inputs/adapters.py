"""Parameter-efficient fine-tuning: LoRA adapters (peft), quantized base weights (bitsandbytes:
QLoRA's NF4/FP4, LLM.int8) and frozen parameters — applied to the model being traced or run,
with the libraries' own code.

- ``--lora r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj[,dropout=0.05]`` (or
  ``targets=all-linear``) wraps the model with ``peft.get_peft_model(model, LoraConfig(...))``:
  the base is frozen (no gradients, no optimizer state), the adapters train. peft keeps the
  adapters in fp32 under a half-precision base (``autocast_adapter_dtype``).
- ``--quantize nf4|fp4|int8`` replaces the ``nn.Linear`` layers transformers would quantize
  (all but the output head and tied weights: ``transformers.quantizers.base.
  get_keys_to_not_convert``; in a model that is not a transformers model, every ``nn.Linear``
  whose weight is not shared, as Lightning's ``BitsandbytesPrecision`` does) by bitsandbytes'
  ``Linear4bit`` / ``Linear8bitLt``, whose weights
  are quantized by bitsandbytes itself — on the meta device for a trace (its quantize operators
  have meta kernels), for real in a measured run. The storage is bitsandbytes' own: NF4/FP4 pack
  two weights per byte with one absmax per 64 weights, double-quantized (QLoRA's default: the
  absmax in 8 bits with an fp32 scale per 256 blocks and a 256-entry code); LLM.int8 keeps one
  int8 per weight and an fp32 scale per row. Forward and backward dequantize the weight into a
  temporary of the compute dtype, as bitsandbytes' ``MatMul4Bit`` / ``MatMul8bitLt`` do. With a
  quantized base, ``peft.prepare_model_for_kbit_training`` runs first, as QLoRA recipes do: it
  freezes the base and casts the remaining half-precision parameters (norms, embeddings, the
  head) to fp32. A model that froze some of its own parameters (its own adapters) keeps
  what it left trainable.
- ``--freeze PATTERN`` (repeatable, ``fnmatch`` over parameter names) freezes what matches.

``parameters`` stays the logical count (a 4-bit weight counts its unpacked elements, as peft's
``print_trainable_parameters`` does); ``trainable_parameters`` counts what trains.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from vramledger.inputs.compat import import_tested
from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic

Quantize = Literal["nf4", "fp4", "int8"]
QUANTIZE: tuple[str, ...] = Quantize.__args__  # type: ignore[attr-defined]
BNB_4BIT_BLOCKSIZE = 64
"""bitsandbytes' ``Params4bit`` default blocksize (and transformers' BitsAndBytesConfig)."""
DOUBLE_QUANT = True
"""QLoRA's ``bnb_4bit_use_double_quant=True``: the absmax quantized again (the QLoRA paper)."""
LLM_INT8_THRESHOLD = 6.0
"""``BitsAndBytesConfig(llm_int8_threshold=6.0)``: outlier columns computed in half precision."""
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    r: int
    alpha: float
    targets: list[str] | str
    dropout: float = 0.0

    def config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=self.targets,
            lora_dropout=self.dropout,
            bias="none",
        )


LORA_HINT = "write it like r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj[,dropout=0.05]"


def parse_lora(text: str) -> LoraSettings:
    """``r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05``: a name without ``=`` continues the
    list of the key before it (the targets)."""
    values: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part:
            key, _, value = part.partition("=")
            key = key.strip().lower()
            values.setdefault(key, []).append(value.strip())
        elif key is not None:
            values[key].append(part)
        else:
            raise InputError(f"--lora {text!r}: {part!r} has no key", hint=LORA_HINT)
    unknown = set(values) - {"r", "alpha", "targets", "dropout"}
    if unknown:
        raise InputError(f"--lora: unknown key {sorted(unknown)[0]!r}", hint=LORA_HINT)
    if "r" not in values or "targets" not in values:
        raise InputError(f"--lora {text!r} needs r= and targets=", hint=LORA_HINT)
    try:
        r = int(values["r"][0])
        alpha = float(values.get("alpha", [str(2 * r)])[0])
        dropout = float(values.get("dropout", ["0"])[0])
    except ValueError as exc:
        raise InputError(f"--lora {text!r}: {exc}", hint=LORA_HINT) from exc
    if r <= 0 or alpha <= 0 or not 0 <= dropout < 1:
        raise InputError(
            f"--lora {text!r}: r and alpha must be positive, dropout in [0, 1)", hint=LORA_HINT
        )
    targets = values["targets"]
    return LoraSettings(
        r=r,
        alpha=alpha,
        targets=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        dropout=dropout,
    )


def _require(package: str, extra: str) -> Any:
    try:
        return import_tested(package)
    except ImportError as exc:
        raise InputError(
            f"this needs {package}", hint=f"pip install 'vramledger[{extra}]'"
        ) from exc


# -- quantized base weights ---------------------------------------------------------------------
def is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (or a peft model around one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(base).__mro__
    )


def _not_converted(model: nn.Module) -> set[str]:
    """Layers left in full precision: transformers' own choice for its models (the output head,
    tied weights, the last module); for any other model only the layers whose weight is shared
    with another module (a head tied to the embedding), as Lightning's
    ``BitsandbytesPrecision`` replaces every other ``nn.Linear``."""
    if is_transformers_model(model):
        from transformers.quantizers.base import get_keys_to_not_convert

        return set(get_keys_to_not_convert(model))
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(name)
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and len(set(owners.get(id(module.weight), []))) > 1
    }


def trainable_choice(model: nn.Module) -> set[str] | None:
    """The parameters a model leaves trainable when it freezes some of its own (its own
    adapters: LitGPT's ``mark_only_lora_as_trainable``), else None (every parameter trains)."""
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    return trainable if len(trainable) < len(params) else None


def keep_trainable(model: nn.Module, names: set[str]) -> None:
    """Make ``names`` trainable again after peft's k-bit preparation froze everything (the
    quantized weights, no longer floating point, stay frozen)."""
    for name, p in model.named_parameters():
        if name in names and p.is_floating_point():
            p.requires_grad_(True)


def quantize_linears(
    model: nn.Module, kind: str, compute_dtype: torch.dtype, device: torch.device
) -> int:
    """Replace the ``nn.Linear`` layers transformers would quantize by bitsandbytes' quantized
    layers, quantized by bitsandbytes on ``device`` (meta for a trace). Returns how many."""
    if kind not in QUANTIZE:
        raise InputError(f"unknown --quantize {kind!r}", hint=f"use {', '.join(QUANTIZE)}")
    bnb = _require("bitsandbytes", "lowbit")
    skip = _not_converted(model)
    count = 0
    # bitsandbytes caches its 8-bit code on the device of the first double quantization
    # (functional.name2qmap): a meta one left there breaks a later real quantization
    codes = dict(bnb.functional.name2qmap)
    try:
        count = _replace_linears(bnb, model, skip, kind, compute_dtype, device)
    finally:
        bnb.functional.name2qmap.clear()
        bnb.functional.name2qmap.update(codes)
    if count == 0:
        raise InputError(
            f"--quantize {kind}: the model has no nn.Linear layer to quantize",
            hint="quantization replaces torch.nn.Linear layers",
        )
    return count


def _replace_linears(
    bnb: Any,
    model: nn.Module,
    skip: set[str],
    kind: str,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> int:
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or any(
                full == s or full.endswith("." + s) for s in skip
            ):
                continue
            setattr(parent, name, _quantized(bnb, child, kind, compute_dtype, device))
            count += 1
    return count


def _quantized(bnb: Any, linear: nn.Linear, kind: str, dtype: torch.dtype, device: torch.device):
    weight = linear.weight.detach().to(dtype)
    # the layer's shape, as both of bitsandbytes' Linear classes take it (built on meta, the
    # quantized weight set below)
    shape: dict[str, Any] = {
        "input_features": linear.in_features,
        "output_features": linear.out_features,
        "bias": linear.bias is not None,
        "device": "meta",
    }
    if kind == "int8":
        layer = bnb.nn.Linear8bitLt(**shape, has_fp16_weights=False, threshold=LLM_INT8_THRESHOLD)
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        layer.weight = layer.weight._quantize(device)
    else:
        layer = bnb.nn.Linear4bit(
            **shape, compute_dtype=dtype, quant_type=kind, compress_statistics=DOUBLE_QUANT
        )
        params = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            quant_type=kind,
            compress_statistics=DOUBLE_QUANT,
            blocksize=BNB_4BIT_BLOCKSIZE,
            module=layer,
        )
        layer.weight = params._quantize(device)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
    return layer


def quantized_tensors(param: torch.Tensor) -> list[tuple[Any, str, torch.Tensor]]:
    """(owner, attribute, tensor) of every tensor a quantized parameter's state holds (the
    4-bit absmax, its nested absmax and code, LLM.int8's row scales), so a trace can make them
    fake tensors too."""
    out: list[tuple[Any, str, torch.Tensor]] = []
    state = getattr(param, "quant_state", None)
    stack = [state] if state is not None else []
    while stack:
        owner = stack.pop()
        for attr, value in vars(owner).items():
            if isinstance(value, torch.Tensor):
                out.append((owner, attr, value))
            elif type(value).__name__ == "QuantState":
                stack.append(value)
    scales = getattr(param, "SCB", None)
    if isinstance(scales, torch.Tensor):
        out.append((param, "SCB", scales))
    return out


def quantization_state(params: Any) -> list[torch.Tensor]:
    """Every tensor of the quantization state of ``params`` (:func:`quantized_tensors`), once
    each: memory beside the packed weights that no parameter shows."""
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        for _, _, t in quantized_tensors(p):
            seen.setdefault(id(t), t)
    return list(seen.values())


def carry_quantization(source: torch.Tensor, target: nn.Parameter, convert: Any) -> nn.Parameter:
    """Give ``target`` (the fake parameter standing for ``source``) the quantization state
    bitsandbytes' layers read from their weight (``quant_state``; LLM.int8's ``CB``/``SCB``),
    with ``convert`` applied to each tensor of it. ``CB`` is the weight itself, as in
    ``Int8Params._quantize``."""
    if not quantized_tensors(source):
        return target
    import copy

    for attr, value in vars(source).items():
        setattr(target, attr, copy.deepcopy(value) if attr == "quant_state" else value)
    for owner, attr, tensor in quantized_tensors(target):
        setattr(owner, attr, convert(tensor))
    if getattr(target, "CB", None) is not None:
        target.CB = target.data
    return target


def logical_numel(param: torch.Tensor) -> int:
    """Elements a parameter stands for (a packed 4-bit weight: its unpacked shape's)."""
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def prepare_for_kbit_training(model: nn.Module) -> None:
    """peft's own preparation of a quantized model (freeze, half parameters to fp32)."""
    peft = _require("peft", "peft")
    peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


# -- adapters and freezing ----------------------------------------------------------------------
def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    peft = _require("peft", "peft")
    try:
        return peft.get_peft_model(model, settings.config())
    except ValueError as exc:
        modules = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _lora_can_target(m)}
        )
        raise InputError(
            f"--lora: {str(exc).splitlines()[0]}",
            hint="targets are module names; this model's layers that peft's LoRA adapts: "
            + ", ".join(modules[:16]),
        ) from exc


LORA_TARGET_TYPES = (
    nn.Linear,
    nn.Embedding,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.MultiheadAttention,
)
"""The layer classes peft's LoRA replaces (``peft/tuners/lora/layer.py: dispatch_default``),
besides transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_fc``, ``c_proj``), matched by name so
that transformers is not imported here."""


def _lora_can_target(module: nn.Module) -> bool:
    cls = type(module)
    return isinstance(module, LORA_TARGET_TYPES) or (
        cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
    )


def freeze(model: nn.Module, patterns: tuple[str, ...]) -> int:
    """Freeze parameters whose names match any pattern; returns how many matched."""
    count = 0
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            param.requires_grad_(False)
            count += 1
    if patterns and count == 0:
        names = [n for n, _ in model.named_parameters()][:8]
        raise InputError(
            f"--freeze {', '.join(patterns)} matches no parameter",
            hint=f"patterns match names like {', '.join(names)}",
        )
    return count


def index_dependent_option(
    model: nn.Module,
    stack: str,
    indices: range,
    freeze_patterns: tuple[str, ...],
    lora: LoraSettings | None,
) -> str | None:
    """The option that picks modules or parameters by a block's index, so that the blocks at
    ``indices`` of the ModuleList ``stack`` would not all be alike in a model that deep
    (``--freeze 'model.layers.1?.*'``, a LoRA target ``layers.20.self_attn.k_proj``); None when
    both options treat every one of them as the first. ``model`` is a shallow build (the block
    extension's): its block 0 gives the names inside a block, and the names of the deeper blocks
    are written from them, so the full model is never built. The matching is the options' own:
    ``fnmatch`` for ``--freeze`` (on the names after LoRA, as ``freeze`` runs last), peft's
    ``check_target_module_exists`` for LoRA targets (on the base model's names, as peft matches
    them)."""
    block = model.get_submodule(f"{stack}.0")
    first = indices[0]
    if lora is not None and isinstance(lora.targets, list):
        from peft.tuners.tuners_utils import check_target_module_exists

        config = lora.config()
        base = stack.removeprefix("base_model.model.") if hasattr(model, "peft_config") else stack
        rests = [
            rest
            for rest, _ in block.named_modules()
            if not any(part == "base_layer" or part.startswith("lora_") for part in rest.split("."))
        ]

        def adapted(index: int) -> frozenset[str]:
            return frozenset(
                rest
                for rest in rests
                if check_target_module_exists(config, f"{base}.{index}.{rest}".rstrip("."))
            )

        if (index := _unlike(adapted, indices)) is not None:
            return (
                f"--lora targets {', '.join(lora.targets)} adapt other modules in block {index} "
                f"of {stack} than in block {first}"
            )
    if freeze_patterns:
        names = [rest for rest, _ in block.named_parameters()]

        def frozen(index: int) -> frozenset[str]:
            return frozenset(
                rest
                for rest in names
                if any(fnmatch.fnmatchcase(f"{stack}.{index}.{rest}", p) for p in freeze_patterns)
            )

        if (index := _unlike(frozen, indices)) is not None:
            return (
                f"--freeze {', '.join(freeze_patterns)} freezes other parameters in block {index} "
                f"of {stack} than in block {first}"
            )
    return None


def _unlike(picked: Any, indices: range) -> int | None:
    """The first index whose pick differs from the first index's."""
    first = picked(indices[0])
    return next((i for i in indices[1:] if picked(i) != first), None)


# -- what the built model holds -----------------------------------------------------------------
def adapter_notes(model: nn.Module) -> list[str]:
    """Notes on the adapters and quantized layers found on the built model (the classes peft and
    bitsandbytes put there, not the options asked for)."""
    lora: dict[str, set[str]] = {}
    ranks: set[int] = set()
    adapter_dtypes: set[str] = set()
    quantized: set[str] = set()
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__module__.startswith("peft.tuners") and hasattr(module, "lora_A"):
            lora.setdefault(f"{cls.__module__}.{cls.__qualname__}", set()).add(
                name.rsplit(".", 1)[-1]
            )
            ranks.update(getattr(module, "r", {}).values())
            adapter_dtypes.update(
                str(p.dtype).removeprefix("torch.") for p in module.lora_A.parameters()
            )
        elif cls.__module__.startswith("bitsandbytes"):
            quantized.add(cls.__qualname__)
    notes = []
    for cls_name, targets in lora.items():
        notes.append(
            f"adapters found on the model: {cls_name} (r={', '.join(map(str, sorted(ranks)))}; "
            f"{'/'.join(sorted(adapter_dtypes))} weights) on {', '.join(sorted(targets))}"
        )
    if quantized:
        notes.append(
            "quantized layers found on the model: "
            + ", ".join(f"bitsandbytes.{cls}" for cls in sorted(quantized))
        )
        if not is_transformers_model(model):
            notes.append(
                "not a transformers model: --quantize replaced every nn.Linear whose weight is "
                "not shared with another module, as Lightning's BitsandbytesPrecision does "
                "(transformers would keep its output head in full precision)"
            )
        fp32 = sorted(
            {
                type(m).__name__
                for n, m in model.named_modules()
                if "lora_" not in n
                and not type(m).__module__.startswith(("bitsandbytes", "peft"))
                and any(p.dtype == torch.float32 for p in m.parameters(recurse=False))
            }
        )
        if fp32:
            notes.append(
                "fp32 parameters on the quantized model, as peft's "
                "prepare_model_for_kbit_training leaves them: "
                + ", ".join(fp32)
                + " (an fp32 norm makes the activations after it fp32)"
            )
    return [Note(Topic.MODEL, n) for n in notes]
