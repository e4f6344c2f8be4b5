"""bitsandbytes' quantized weights in a user's program under ``vramledger run``: quantized on
the emulated GPU with bitsandbytes' own code, in bitsandbytes' own storage layout.

A program quantizes with bitsandbytes (``from_pretrained(..., quantization_config=
BitsAndBytesConfig(load_in_4bit=True))``, ``bnb.nn.Linear4bit(...).cuda()``, Lightning's
``BitsandbytesPrecision``, which LitGPT's ``--quantize bnb.nf4`` uses) by making its layers'
weights as bitsandbytes' parameter classes (``Params4bit``, ``Int8Params``) and quantizing them
as they reach the GPU (``Params4bit.to("cuda")`` / ``.cuda()`` / ``_quantize``;
``bnb.functional.quantize_4bit`` of a CUDA tensor). In the trace (:class:`EmulatedQuantization`):

- a ``Params4bit``/``Int8Params`` of an emulated tensor, which ``Tensor._make_subclass`` cannot
  wrap (it is bound to ``FakeTensor``), is made on a meta stand-in of its shape, and the
  emulated tensor is kept for it: it is on the GPU, unquantized, as in the GPU run;
- quantizing one toward the GPU (its own ``_quantize``, reached by ``to``/``cuda``/
  ``Module.cuda``/``Module.to("cuda")``) runs bitsandbytes' own quantization on the emulated
  tensors, recorded like any operator (``bnb.functional.quantize_4bit``: the packed 4-bit
  weight, its fp32 absmax, double quantization's 8-bit absmax, fp32 scale per 256 blocks and
  256-entry code; ``int8_vectorwise_quant`` of an fp16 copy for LLM.int8: int8 weight and fp32
  row scales). The weight becomes an emulated parameter carrying the attributes bitsandbytes'
  layers read (``quant_state``, ``blocksize``, ``CB``/``SCB`` ...) as ``estimate --quantize``'s
  weights do (``adapters.carry_quantization``), and ``isinstance(weight, Params4bit)`` is true
  of it, as of the GPU run's weight; the weight and its state are parameters in the ledger;
- Lightning's ``_Linear4bit``/``_Linear8bitLt`` quantize at construction when their weight is on
  CUDA (``torch.tensor(0, device=device).device.type == "cuda"``, which an emulated tensor,
  reporting the CPU, does not meet): they are quantized there, as on the GPU;
- bitsandbytes' cache of its 8-bit code (``bnb.functional.name2qmap``) starts empty and is
  given back as it was, so its emulated table (made on the GPU once, 1 KiB, as in a GPU run)
  does not outlive the trace;
- on the CUDA target, ``Linear4bit`` does not take its CPU inference layout
  (``has_avx512bf16``: ``_convert_weight_packed_for_cpu`` for an eval-mode forward without
  gradients on a CPU with AVX512-BF16), which a GPU never does.

Forward and backward then run bitsandbytes' own ``MatMul4Bit``/``MatMul8bitFp`` on the emulated
tensors, as ``estimate --quantize`` does (their operators have fake kernels; their
device-dependent branches see the CPU that emulated tensors report, as ``estimate``'s do).

The real CPU run (``--measure``) quantizes with bitsandbytes' CPU backend (bitsandbytes 0.46 and
later): nothing is patched for ``from_pretrained`` or bitsandbytes' own layers. Lightning's
``_Linear4bit`` quantizes only a CUDA tensor (``quantize`` raises for any other device, and its
weights stay unquantized on a CPU, where LitGPT then fails reading ``quant_state``), so
:func:`real_quantization` stops that run in one line where Lightning's plugin is
made.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

from vramledger.inputs.adapters import quantized_tensors
from vramledger.inputs.categories import Category
from vramledger.inputs.errors import TraceError
from vramledger.inputs.import_hooks import when_imported

MODULE = "bitsandbytes.nn.modules"
LIGHTNING_MODULE = "lightning.fabric.plugins.precision.bitsandbytes"
LIGHTNING_LAYERS = ("_Linear4bit", "_Linear8bitLt")
"""Lightning's layers that quantize at construction on CUDA (in ``LIGHTNING_MODULE``'s globals
once its ``_import_bitsandbytes`` has run)."""

Register = Callable[[list[torch.Tensor], Category], None]


class _Patches:
    """Attributes replaced until :meth:`restore` (``mock.patch.object``, last first)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._stack.enter_context(mock.patch.object(owner, name, value, create=True))

    def then(self, undo: Callable[[], None]) -> None:
        self._stack.callback(undo)

    def restore(self) -> None:
        self._stack.close()


def _fresh_code_cache(patches: _Patches) -> None:
    """bitsandbytes' cache of its 8-bit code (``bnb.functional.name2qmap``) empty, as in a new
    process, until ``patches`` are restored (then as it was): a table cached by an earlier run
    in this process would be missing from the program's memory."""
    cache = sys.modules["bitsandbytes.functional"].name2qmap
    saved = dict(cache)
    cache.clear()

    def give_back() -> None:
        cache.clear()
        cache.update(saved)

    patches.then(give_back)


class EmulatedQuantization:
    """While active (a context manager), bitsandbytes quantizes on the emulated GPU (module
    docstring): ``register(tensors, category)`` records the quantized weights and their state;
    ``cuda_target``: the prediction is for a GPU (not the CPU's allocator)."""

    def __init__(self, register: Register, cuda_target: bool) -> None:
        self.register = register
        self.cuda_target = cuda_target
        self.emulated: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Stand-in parameter -> the emulated tensor it holds (unquantized, on the GPU)."""
        self.stands_for: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Emulated quantized parameter -> the bitsandbytes class it stands for."""
        self.quantized = 0
        """Weights quantized on the emulated GPU so far."""
        self.in_lightning = 0
        """Inside a Lightning layer's ``quantize_`` (which counts its own)."""
        self.patches = _Patches()
        self._imports = contextlib.ExitStack()

    def __enter__(self) -> EmulatedQuantization:
        meta = type(nn.Parameter)
        self.patches.set(meta, "__instancecheck__", self.instancecheck(meta.__instancecheck__))
        self._imports.enter_context(when_imported(MODULE, self.patch))
        self._imports.enter_context(when_imported(LIGHTNING_MODULE, self.patch_lightning))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._imports.close()
        self.patches.restore()

    def note(self) -> str | None:
        if not self.quantized:
            return None
        return (
            f"bitsandbytes quantized weights on the emulated GPU {self.quantized} times, with its "
            "own code (quantize_4bit / int8_vectorwise_quant of the weight there); the packed "
            "weights and their quantization state are parameters"
        )

    # -- the parameter classes ------------------------------------------------------------------
    def patch(self, modules: ModuleType) -> None:
        """Patch ``bitsandbytes.nn.modules``' parameter classes (once it is imported)."""
        _fresh_code_cache(self.patches)
        if self.cuda_target:
            self.patches.set(modules, "has_avx512bf16", lambda: False)
        for cls, quantize in (
            (modules.Params4bit, self._quantize_4bit),
            (modules.Int8Params, self._quantize_8bit),
        ):
            self._patch_class(cls, quantize)

    def _patch_class(self, cls: type, quantize: Callable[[Any, Any], Any]) -> None:
        new, to, own_quantize = cls.__dict__["__new__"], cls.to, cls._quantize
        quantizer = self

        def new_(cls_: type, data: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(data, FakeTensor):
                return new(cls_, data, *args, **kwargs)
            if _is_quantized(data, kwargs):
                return quantizer.emulated_parameter(cls_, data, kwargs)
            meta = torch.empty(data.shape, dtype=data.dtype, device="meta")
            stand_in = new(cls_, meta, *args, **kwargs)
            quantizer.emulated[stand_in] = data
            return stand_in

        def to_(self: Any, *args: Any, **kwargs: Any) -> Any:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if self in quantizer.emulated and device is not None and device.type != "meta":
                return self._quantize(device)
            return to(self, *args, **kwargs)

        def quantize_(self: Any, device: Any) -> Any:
            if self in quantizer.emulated or torch.device(device).type == "cuda":
                return quantize(self, device)
            return own_quantize(self, device)

        self.patches.set(cls, "__new__", new_)
        self.patches.set(cls, "to", to_)
        self.patches.set(cls, "_quantize", quantize_)

    def _weight(self, param: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The unquantized weight on the emulated GPU (moved there if the program made it on the
        CPU: ``Tensor.to("cuda")`` under the emulation)."""
        weight = self.emulated.pop(param, None)
        if weight is None:
            weight = param.data.to("cuda")
        weight = weight.contiguous()
        return weight if dtype is None else weight.to(dtype)

    def _quantize_4bit(self, param: Any, _device: Any) -> Any:
        import bitsandbytes as bnb

        packed, state = bnb.functional.quantize_4bit(
            self._weight(param),
            blocksize=param.blocksize,
            compress_statistics=param.compress_statistics,
            quant_type=param.quant_type,
            quant_storage=param.quant_storage,
        )
        attributes = {**vars(param), "quant_state": state, "bnb_quantized": True}
        if param.module is not None:
            param.module.quant_state = state
        # double quantization's 8-bit code, made on the GPU once and cached for the process
        # (each state holds a copy of it)
        codes = bnb.functional.name2qmap.values()
        self.register([t for t in codes if isinstance(t, FakeTensor)], Category.PARAMETERS)
        return self.emulated_parameter(type(param), packed, attributes, param.requires_grad)

    def _quantize_8bit(self, param: Any, device: Any) -> Any:
        import bitsandbytes as bnb

        if param.has_fp16_weights:
            return self.emulated_parameter(
                type(param), self._weight(param), vars(param), param.requires_grad
            )
        weights, scales, _ = bnb.functional.int8_vectorwise_quant(
            self._weight(param, torch.float16)
        )
        attributes = {**vars(param), "CB": weights, "SCB": scales}
        return self.emulated_parameter(type(param), weights, attributes, param.requires_grad)

    def emulated_parameter(
        self,
        cls: type,
        data: torch.Tensor,
        attributes: dict[str, Any],
        requires_grad: bool | None = None,
        *,
        count: bool = True,
    ) -> torch.Tensor:
        """The emulated parameter standing for a quantized ``cls`` of ``data``: a fake
        parameter with the attributes bitsandbytes' layers read, registered with its state."""
        if requires_grad is None:
            requires_grad = bool(attributes.get("requires_grad", False))
        param = nn.Parameter(data, requires_grad=requires_grad)
        for name, value in attributes.items():
            if name not in ("data", "requires_grad"):
                setattr(param, name, value)
        if cls.__name__ == "Int8Params" and getattr(param, "CB", None) is not None:
            param.CB = data
        self.stands_for[param] = cls
        self.register([param, *(t for _, _, t in quantized_tensors(param))], Category.PARAMETERS)
        if count and not self.in_lightning:
            self.quantized += 1
        return param

    def instancecheck(self, original: Callable[[type, Any], bool]) -> Callable[[type, Any], bool]:
        """``isinstance(weight, Params4bit)`` of an emulated quantized weight: true."""
        stands_for = self.stands_for

        def check(cls: type, instance: Any) -> bool:
            if isinstance(instance, FakeTensor):
                stands = stands_for.get(instance)
                if stands is not None and issubclass(stands, cls):
                    return True
            return original(cls, instance)

        return check

    # -- Lightning's layers ---------------------------------------------------------------------
    def patch_lightning(self, module: ModuleType) -> None:
        """Lightning's layers quantize at construction on the emulated GPU, as on a GPU."""
        load = module._import_bitsandbytes
        quantizer = self

        def import_bitsandbytes() -> ModuleType:
            bnb = load()
            for name in LIGHTNING_LAYERS:
                cls = module.__dict__.get(name)
                if isinstance(cls, type) and "__init__" in cls.__dict__:
                    quantizer._quantize_at_init(cls)
            return bnb

        self.patches.set(module, "_import_bitsandbytes", import_bitsandbytes)

    def _quantize_at_init(self, cls: type) -> None:
        """``cls.__init__`` quantizes a weight made on the emulated GPU, as Lightning's does on
        CUDA; ``cls.quantize_`` (also the checkpoint's load hook) registers what it leaves on
        the layer. Lightning's 8-bit layer sets its ``Int8Params``' data in place, so its
        stand-in becomes an emulated parameter first."""
        if getattr(cls.__init__, "_vramledger_wrapped", False):
            return
        init, quantize = cls.__init__, cls.quantize_
        quantizer = self

        def init_(layer: Any, *args: Any, **kwargs: Any) -> None:
            init(layer, *args, **kwargs)
            weight = quantizer.emulated.get(layer.weight)
            if weight is None:  # not made on the emulated GPU
                return
            if type(layer.weight).__name__ == "Int8Params":
                stand_in = layer.weight
                layer.weight = quantizer.emulated_parameter(
                    type(stand_in), weight, vars(stand_in), stand_in.requires_grad, count=False
                )
            layer.quantize_(weight)

        def quantize_(layer: Any, *args: Any, **kwargs: Any) -> None:
            quantizer.in_lightning += 1
            try:
                quantize(layer, *args, **kwargs)
            finally:
                quantizer.in_lightning -= 1
            weight = layer.weight
            if weight in quantizer.stands_for:
                tensors = [weight, *(t for _, _, t in quantized_tensors(weight))]
                quantizer.register(tensors, Category.PARAMETERS)
                quantizer.quantized += 1

        init_._vramledger_wrapped = True  # type: ignore[attr-defined]
        self.patches.set(cls, "__init__", init_)
        self.patches.set(cls, "quantize_", quantize_)

    def move(self, param: torch.Tensor) -> torch.Tensor | None:
        """:func:`quantizing_move`, and of a stand-in (an unquantized weight made on the
        emulated GPU) too."""
        return param.to("cuda") if param in self.emulated else quantizing_move(param)


def quantizing_move(param: torch.Tensor) -> torch.Tensor | None:
    """``Module.cuda()``/``Module.to("cuda")`` of an unquantized bitsandbytes parameter: its own
    ``to("cuda")``, which quantizes it, as ``Module._apply`` calls it on a GPU; None for any
    other parameter (moved as usual)."""
    if (
        type(param).__module__ == MODULE
        and param.dtype not in (torch.uint8, torch.int8)
        and param.device.type != "meta"
    ):
        return param.to("cuda")
    return None


def _is_quantized(data: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """A bitsandbytes parameter made of already-quantized data (Lightning's ``_replace_param``,
    ``from_prequantized``): packed or int8 storage, or a quantization state given with it."""
    return (
        kwargs.get("quant_state") is not None
        or bool(kwargs.get("bnb_quantized"))
        or data.dtype in (torch.uint8, torch.int8)
    )


# -- the real CPU run ---------------------------------------------------------------------------
def lightning_refusal() -> TraceError:
    return TraceError(
        "the program quantizes with Lightning's BitsandbytesPrecision, which quantizes only on a "
        "real CUDA device: its layers stay unquantized on the CPU, so vramledger run --measure "
        "cannot run it (the trace, without --measure, emulates it)",
        hint="predict it with `vramledger run --gpu GPU -- PROGRAM` (or --target cpu)",
    )


@contextlib.contextmanager
def real_quantization() -> Iterator[None]:
    """The real CPU run: bitsandbytes' code cache starts empty, as in a new process, and making
    Lightning's ``BitsandbytesPrecision`` raises :func:`lightning_refusal`'s error."""
    patches = _Patches()

    def patch(module: ModuleType) -> None:
        def refuse(*_args: Any, **_kwargs: Any) -> None:
            raise lightning_refusal()

        patches.set(module.BitsandbytesPrecision, "__init__", refuse)

    try:
        with (
            when_imported("bitsandbytes.functional", lambda _: _fresh_code_cache(patches)),
            when_imported(LIGHTNING_MODULE, patch),
        ):
            yield
    finally:
        patches.restore()
