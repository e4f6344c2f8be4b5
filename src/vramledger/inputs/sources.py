"""Where the model, its inputs and its loss come from.

A model is a Hugging Face config (a ``config.json`` file or a folder holding one; the task is
read from ``architectures`` unless given), Python code (``FILE.py:FUNCTION`` or
``package.module:FUNCTION`` returning an ``nn.Module``), or — from Python — an ``nn.Module``
instance or a zero-argument callable. Inputs and loss are code references of the same form.
Nothing here touches a model hub: configs are read from local files only.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from vramledger.inputs.attention import register_modelled_flash_attention
from vramledger.inputs.errors import InputError
from vramledger.inputs.jsonfile import read_json_object
from vramledger.inputs.tasks import (
    KINDS,
    TASKS,
    TEXT_ONLY_SPEECH,
    has_audio_inputs,
    infer_task,
    model_class,
    text_config,
)

InputsFn = Callable[..., Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A way to build the model and, where known, its default inputs."""

    name: str
    """What to call the model in reports."""
    build: Callable[[], nn.Module]
    """Builds the model on the current default device (meta for tracing, cpu for measuring)."""
    task: str | None = None
    config: Any = None
    """The Hugging Face config, when the model comes from one."""
    skip_init: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """A context that skips weight initialisation (memory does not depend on the values)."""
    supports_hf_checkpointing: bool = False
    declared_dtype: str | None = None
    """The dtype a Hugging Face config declares (``"dtype"``, older ``"torch_dtype"``): how its
    checkpoint is stored. It does not decide the training precision: models are built in fp32
    and ``--precision`` casts them."""
    attn_implementation: str | None = None
    """The attention path asked for (``--attn-implementation``; attention.py); None: the
    model's default."""
    builder: Callable[[Any], Callable[[], nn.Module]] | None = None
    """For a config: makes ``build`` for another config (a shallow copy of the model) with every
    other option of this source, so a model of any depth is built the one way the full model
    is (:meth:`with_config`)."""

    def with_config(self, config: Any) -> ModelSource:
        """This source with another Hugging Face config (e.g. fewer layers), every build option
        kept: ``build`` is made by the same function that made this source's."""
        if self.builder is None:
            raise ValueError(f"{self.name} is not built from a config")
        return replace(self, config=config, build=self.builder(config))


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    batch_size: int
    seq_len: int
    image_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Makes the batch: ``inputs(device, shape)``."""

    make: Callable[[torch.device, BatchShape], Any]
    uses: frozenset[str]
    """The BatchShape fields the batch follows (an inputs function that makes its own sequence
    length does not use ``seq_len``: the default must not be checked against the model)."""
    note: str | None = None
    """What a default batch leaves out, for the notes."""

    def __call__(self, device: torch.device, shape: BatchShape) -> Any:
        return self.make(device, shape)


# -- code references --------------------------------------------------------------------------
def load_callable(ref: str, what: str) -> Callable[..., Any]:
    """Load ``FILE.py:NAME`` or ``package.module:NAME``."""
    if ":" not in ref:
        raise InputError(
            f"{what} {ref!r} is not a code reference",
            hint="write it as FILE.py:FUNCTION or package.module:FUNCTION",
        )
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py") or Path(target).exists():
        path = Path(target)
        if not path.is_file():
            raise InputError(f"{what} file {target} not found", hint="check the path")
        module_name = f"_vramledger_user_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise InputError(f"cannot import {target} as Python code")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's file raised while importing
            raise InputError(
                f"importing {target} failed: {type(exc).__name__}: {exc}",
                hint="run the file with python to see the full error (or pass --debug)",
            ) from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise InputError(
                f"cannot import module {target!r} for the {what}: {exc}",
                hint="check the module path, or give a file as FILE.py:FUNCTION",
            ) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InputError(
            f"{target} has no function {attr!r} for the {what}",
            hint=f"it defines: {', '.join(names[:12]) or 'nothing callable'}",
        )
    return fn


def _call_user(fn: Callable[..., Any], what: str, /, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except InputError:
        raise
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise InputError(
            f"the {what} {name} raised {type(exc).__name__}: {exc}",
            hint="fix the function (pass --debug for the traceback)",
        ) from exc


# -- Hugging Face configs ---------------------------------------------------------------------
def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InputError(
            "reading a Hugging Face config needs transformers",
            hint="pip install 'vramledger[hf]'",
        ) from exc
    return transformers


def load_hf_config(path: str | Path) -> Any:
    """Read a local ``config.json`` (or a folder with one) into a transformers config object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    data = read_json_object(path, "config file", hint="give a config.json or its folder")
    if "model_type" not in data:
        raise InputError(
            f"{path} has no 'model_type'",
            hint='a Hugging Face config.json names its model_type (e.g. "llama")',
        )
    return hf_config_from_dict(data, origin=str(path))


def hf_config_from_dict(data: dict[str, Any], *, origin: str = "config") -> Any:
    transformers = _require_transformers()
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        config_cls = transformers.CONFIG_MAPPING[model_type]
    except KeyError as exc:
        raise InputError(
            f"{origin}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__}",
            hint="upgrade transformers, or give the model as Python code (FILE.py:FUNCTION)",
        ) from exc
    # save_pretrained writes non-finite floats as {"__float__": "Infinity"}; decode as it reads
    decode = getattr(config_cls, "_decode_special_floats", None)
    if decode is not None:
        data = decode(data)
    try:
        return config_cls(**data)
    except Exception as exc:
        raise InputError(f"{origin}: transformers rejected the config: {exc}") from exc


def _hf_skip_init() -> contextlib.AbstractContextManager:
    _require_transformers()
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        ctx = getattr(module, "no_init_weights", None)
        if ctx is not None:
            return ctx()
    return contextlib.nullcontext()


def hf_source(
    config: Any, task: str | None, name: str, attn_implementation: str | None = None
) -> ModelSource:
    transformers = _require_transformers()
    task = task or infer_task(config)
    if task not in KINDS:
        raise InputError(f"unknown task {task!r}", hint=f"use one of {', '.join(TASKS)}")
    if task in ("sequence-classification", "masked-lm"):
        # Decoder classifiers find each row's last token through pad_token_id (a batch > 1 needs
        # one) and masked LMs (ESM) mask padding with it; the default batch has no padding.
        for part in {id(c): c for c in (config, text_config(config))}.values():
            if getattr(part, "pad_token_id", None) is None:
                part.pad_token_id = 0
    auto_cls = getattr(transformers, KINDS[task].auto_class)

    def builder(config: Any) -> Callable[[], nn.Module]:
        """Every option of the build reads from this closure: a shallow copy of the config
        (``ModelSource.with_config``) is built with the same task, attention path and dtype."""

        def build() -> nn.Module:
            return _build_hf(config, auto_cls, task, attn_implementation)

        return build

    return ModelSource(
        name=name,
        build=builder(config),
        declared_dtype=declared_dtype(config),
        builder=builder,
        task=task,
        config=config,
        skip_init=_hf_skip_init,
        supports_hf_checkpointing=True,
        attn_implementation=attn_implementation,
    )


def _build_hf(config: Any, auto_cls: Any, task: str, attn_implementation: str | None) -> nn.Module:
    """The model of ``config`` from transformers' auto class, in fp32, with the attention path
    asked for."""
    built = copy.deepcopy(config)
    if built.architectures is None:  # auto classes with several heads iterate over it
        built.architectures = []
    extra: dict[str, Any] = {}
    if attn_implementation == "flash_attention_2":
        extra["attn_implementation"] = register_modelled_flash_attention()
    elif attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    try:
        # In fp32 whatever dtype the config declares; the precision mode casts afterwards.
        model = auto_cls.from_config(built, dtype=torch.float32, **extra)
    except ValueError as exc:
        raise InputError(
            f"transformers has no {task} model for model_type {config.model_type!r}: "
            f"{str(exc).splitlines()[0]}",
            hint="choose another --task",
        ) from exc
    # Skipping initialisation also skips tying (tie_weights runs in init_weights).
    model.tie_weights()
    return model


def declared_dtype(config: Any) -> str | None:
    """The checkpoint dtype a config declares, as a name ('bfloat16'), or None."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None or value == "auto":
        return None
    return str(value).removeprefix("torch.")


# -- resolution -------------------------------------------------------------------------------
def resolve_model(
    model: Any, task: str | None = None, attn_implementation: str | None = None
) -> ModelSource:
    """Turn what the user gave (path, code reference, module, callable, config) into a source."""
    source = _resolve_model(model, task, attn_implementation)
    if attn_implementation is not None and source.config is None:
        raise InputError(
            "--attn-implementation chooses a Hugging Face model's attention path, and this model "
            "is Python code",
            hint="drop it, or give a config.json",
        )
    return source


def _resolve_model(model: Any, task: str | None, attn: str | None) -> ModelSource:
    if task is not None and task not in TASKS:
        raise InputError(f"unknown task {task!r}", hint=f"use one of {', '.join(TASKS)}")
    if isinstance(model, nn.Module):
        return _module_instance_source(model)
    if isinstance(model, (str, Path)):
        text = str(model)
        path = Path(text)
        if path.suffix == ".json" or path.is_dir():
            return hf_source(
                load_hf_config(path), task, name=path.stem if path.is_file() else path.name,
                attn_implementation=attn,
            )  # fmt: skip
        if ":" in text:
            factory = load_callable(text, "model factory")
            return ModelSource(name=text.rpartition(":")[2], build=_checked_factory(factory, text))
        if not path.exists():
            raise InputError(
                f"model {text!r} not found",
                hint="give a config.json, a folder holding one, or FILE.py:FUNCTION",
            )
        raise InputError(
            f"cannot read a model from {text!r}", hint="give a config.json or FILE.py:FUNCTION"
        )
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):  # a transformers config
        return hf_source(model, task, name=model.model_type, attn_implementation=attn)
    if isinstance(model, dict) and "model_type" in model:
        return hf_source(
            hf_config_from_dict(model), task, name=model["model_type"], attn_implementation=attn
        )
    if callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        return ModelSource(name=name, build=_checked_factory(model, name))
    raise InputError(f"cannot use {type(model).__name__} as a model")


def _checked_factory(factory: Callable[[], Any], ref: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module = _call_user(factory, "model factory")
        if not isinstance(module, nn.Module):
            raise InputError(
                f"the model factory {ref} returned {type(module).__name__}, not an nn.Module"
            )
        return module

    return build


def _module_instance_source(module: nn.Module) -> ModelSource:
    """A built module: tracing copies its structure onto the meta device (no real memory)."""

    def build() -> nn.Module:
        device = torch.get_default_device()
        if device.type != "meta":
            return copy.deepcopy(module)
        memo: dict[int, Any] = {}
        for t in (*module.parameters(), *module.buffers()):
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = (
                nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
            )
        return copy.deepcopy(module, memo)

    return ModelSource(name=type(module).__name__, build=build)


# -- inputs -----------------------------------------------------------------------------------
def resolve_inputs(inputs: Any, source: ModelSource) -> Inputs:
    """What makes the batch: ``(device, shape) -> batch``."""
    if inputs is None:
        if source.config is None:
            raise InputError(
                f"no inputs for {source.name}: only Hugging Face configs have default inputs",
                hint="pass --inputs FILE.py:FUNCTION (called with device=, batch_size=, seq_len=)",
            )
        return partial_hf_inputs(source)
    fn = load_callable(inputs, "inputs function") if isinstance(inputs, str) else inputs
    params = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    uses = frozenset(
        key for key in ("batch_size", "seq_len", "image_size") if key in params or accepts_any
    )

    def make(device: torch.device, shape: BatchShape) -> Any:
        kwargs: dict[str, Any] = {"device": device}
        for key in sorted(uses):
            if getattr(shape, key) is not None:
                kwargs[key] = getattr(shape, key)
        batch = _call_user(fn, "inputs function", **kwargs)
        if not tensor_leaves(batch):
            raise InputError(
                f"the inputs function returned {type(batch).__name__} with no tensors",
                hint="return a dict, tuple or tensor",
            )
        return batch

    return Inputs(make=make, uses=uses)


def partial_hf_inputs(source: ModelSource) -> Inputs:
    """The default batch of the source's task (``tasks.py``)."""
    config, kind = source.config, KINDS[source.task]
    cls = model_class(config, source.task)
    text_first = getattr(cls, "main_input_name", None) == "input_ids"
    if source.task == "speech-seq2seq" and (text_first or not has_audio_inputs(config)):
        # speech LLMs (Voxtral, Granite Speech ...) take a text-only batch as well
        kind = replace(KINDS["causal-lm"], note=TEXT_ONLY_SPEECH)

    def make(device: torch.device, shape: BatchShape) -> dict[str, torch.Tensor]:
        return kind.make(config, cls, device, shape)

    return Inputs(make=make, uses=kind.uses, note=kind.note)


# -- loss -------------------------------------------------------------------------------------
def resolve_loss(loss: Any) -> LossFn:
    if loss is None:
        return default_loss
    fn = load_callable(loss, "loss function") if isinstance(loss, str) else loss

    def call(model: nn.Module, batch: Any) -> torch.Tensor:
        value = fn(model, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InputError(
                f"the loss function returned {type(value).__name__}"
                + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
                + ", not a scalar tensor"
            )
        return value

    return call


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``output.loss`` of models that compute their own loss (Hugging Face models with labels)."""
    try:
        out = call_model(model, batch)
    except TypeError as exc:
        raise InputError(
            f"calling {type(model).__name__} with the batch failed ({exc})",
            hint="pass --loss FILE.py:FUNCTION, called as loss(model, batch) and returning the scalar loss",
        ) from exc
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise InputError(
            f"the model's output ({type(out).__name__}) has no loss",
            hint="pass --loss FILE.py:FUNCTION, called as loss(model, batch) and returning the scalar loss",
        )
    return loss


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, through nested dicts, lists, tuples
    and the containers ``torch.utils._pytree`` knows (other mappings, e.g. a tokenizer's
    ``BatchEncoding``, become dicts)."""
    return pytree.tree_map_only(torch.Tensor, fn, _as_pytree(obj))


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in order, through the containers ``map_tensors`` goes through."""
    return [t for t in pytree.tree_leaves(_as_pytree(obj)) if isinstance(t, torch.Tensor)]


def _as_pytree(obj: Any) -> Any:
    """``obj`` with a mapping that ``torch.utils._pytree`` does not know (a dict subclass, a
    tokenizer's ``BatchEncoding``) as a dict, its values likewise, so that pytree walks it."""
    if isinstance(obj, Mapping) and type(obj) not in pytree.SUPPORTED_NODES:
        return {k: _as_pytree(v) for k, v in obj.items()}
    return obj
