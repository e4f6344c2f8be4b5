"""bitsandbytes' quantized weights in a user's program: refused in one line by ``vramledger
run``, with and without ``--measure``.

A program that quantizes with bitsandbytes (``litgpt finetune_lora --quantize bnb.nf4``,
Lightning's ``BitsandbytesPrecision``, ``bnb.nn.Linear4bit``/``Linear8bitLt`` used directly)
makes its layers' weights as bitsandbytes' tensor subclasses (``Params4bit``, ``Int8Params``)
and quantizes them only once they are on a real CUDA device: Lightning's ``_Linear4bit``
quantizes when ``torch.tensor(0, device=device).device.type == "cuda"`` and its ``quantize``
raises for any other device type; bitsandbytes' own ``Params4bit.to``/``.cuda`` quantize as the
tensor moves. Neither run here has such a device:

- the trace: a ``Params4bit`` cannot wrap a fake tensor (``Tensor._make_subclass`` refuses one
  already bound to ``FakeTensor``), and an emulated tensor reports the CPU, so the quantization
  would not run either: the trace would hold the full-precision weights;
- the real CPU run (``--measure``): "cuda" is the CPU and ``.to("cuda")`` is the tensor itself,
  so the weights are never quantized (LitGPT then fails reading ``quant_state``, which is None:
  ``litgpt/utils.py``'s ``num_parameters``). Plain LitGPT on the CPU refuses earlier, in
  Lightning: "Bitsandbytes is only supported on CUDA GPUs." (``fabric/connector.py``).

So :func:`refused_quantized_weights` stops the program where the first such weight is made,
with one line that says why and what does model QLoRA (``estimate --lora --quantize``, where
bitsandbytes quantizes on the meta device: ``adapters.py``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .errors import TraceError

MODULE = "bitsandbytes.nn.modules"
QUANTIZED = ("Params4bit", "Int8Params")
"""bitsandbytes' quantized weight classes (in ``MODULE``)."""


def refusal(name: str) -> TraceError:
    return TraceError(
        f"the program makes bitsandbytes' quantized weights ({name}), which vramledger run does "
        "not model: bitsandbytes quantizes them only on a real CUDA device, which neither the "
        "fake-tensor trace nor the real CPU run (--measure) has",
        hint="run the program without its quantization (litgpt: no --quantize), or predict "
        "QLoRA with `vramledger estimate MODEL --lora ... --quantize nf4`",
    )


def _refusing(name: str) -> Callable[..., Any]:
    def new(_cls: type, *_args: Any, **_kwargs: Any) -> Any:
        raise refusal(name)

    return new


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once ``name`` has been executed, when the program imports it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the other finders find it; this one only waits for it
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, then = loader.exec_module, self.then

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            then(module)

        loader.exec_module = exec_then
        return spec


@contextlib.contextmanager
def refused_quantized_weights() -> Iterator[None]:
    """While active, making one of bitsandbytes' quantized weights (``QUANTIZED``) raises
    :func:`refusal`'s error: their ``__new__`` is replaced, now if bitsandbytes is imported,
    else when the program imports it. Restored on exit."""
    restore: list[tuple[type, Any]] = []

    def patch(module: ModuleType) -> None:
        for name in QUANTIZED:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and not restore_has(cls):
                restore.append((cls, cls.__dict__["__new__"]))
                cls.__new__ = _refusing(name)  # type: ignore[method-assign]

    def restore_has(cls: type) -> bool:
        return any(c is cls for c, _ in restore)

    finder = None
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    else:
        finder = _OnImport(MODULE, patch)
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for cls, new in reversed(restore):
            cls.__new__ = new  # type: ignore[method-assign]
