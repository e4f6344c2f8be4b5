"""Checkpoints read as shapes, without their data, for a program run with CUDA emulated.

A program that loads a checkpoint needs its tensors' shapes and dtypes, never their values
(what it puts on "cuda" is a fake tensor). So, while :func:`weights_without_data` is active:

- ``safetensors.torch.load_file`` and ``safetensors.safe_open(...).get_tensor / get_slice``
  read the file's header only (8 bytes little-endian: the header's length, then JSON naming
  each tensor's dtype, shape and data offsets; https://github.com/huggingface/safetensors)
  and give uninitialised tensors of those shapes and dtypes (``torch.empty``: host pages that
  are never written stay unmapped, so a 2 GiB file costs no resident memory), on the device
  asked for (on "cuda" they are emulated, fake tensors);
- ``torch.load`` of a file ``torch.save`` wrote (a zip archive) maps it (``mmap=True``)
  instead of reading it: no page is read unless the program reads its values;
- ``from_pretrained`` of transformers' models on a local folder with only ``config.json``
  builds the model from its config, with random weights, instead of raising ``OSError``.

Each load is listed (:attr:`CheckpointShapes.read`) for the notes. ``--measure`` (a real run)
reads checkpoints for real; this module is not active there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HEADER_LENGTH_BYTES = 8
"""A safetensors file opens with its header's length, an unsigned 64-bit little-endian int."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names (its ``Dtype`` enum) and torch's."""

SYNCHRONOUS_LOADING = "HF_DEACTIVATE_ASYNC_LOAD"
"""transformers (``core_model_loading.convert_and_load_state_dict_in_model``) loads weights in a
thread pool unless this is set; the CUDA emulation is a thread-local TorchFunctionMode, so a
worker's ``.to("cuda")`` would reach the real (absent) CUDA backend. Shapes need no parallel
reads."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
"""Files in a model folder that hold weights; a folder with none is built from its config."""


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """A safetensors file's tensors (name -> {"dtype", "shape", "data_offsets"}) and its
    metadata, read from its header alone."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata


def _empty(entry: dict[str, Any], device: Any) -> torch.Tensor:
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    if isinstance(device, int):
        device = f"cuda:{device}"
    return torch.empty(entry["shape"], dtype=dtype, device=device)


class _Slice:
    """``safe_open(...).get_slice(name)``: its shape and dtype, and ``[...]`` giving the tensor
    (indexed)."""

    def __init__(self, entry: dict[str, Any], device: Any) -> None:
        self._entry, self._device = entry, device

    def get_shape(self) -> list[int]:
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        return self._entry["dtype"]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return _empty(self._entry, self._device)[index]


@dataclass(kw_only=True)
class CheckpointShapes:
    """What :func:`weights_without_data` saw."""

    read: list[str] = field(default_factory=list)
    """Files read as shapes (each once)."""
    from_config: list[str] = field(default_factory=list)
    """Folders with only a config, built from it with random weights."""

    def saw(self, path: Any) -> None:
        name = str(path)
        if name not in self.read:
            self.read.append(name)

    def notes(self) -> list[str]:
        notes = [f"weights read as shapes from {name} (no data read)" for name in self.read]
        notes += [
            f"{name} has a config and no weights: the model was built from its config "
            "(random weights; memory is the same)"
            for name in self.from_config
        ]
        return notes


def _safe_open_class(shapes: CheckpointShapes) -> type:
    class SafeOpen:
        """``safetensors.safe_open`` from the header: tensors without data."""

        def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", **_: Any):
            self._header, self._metadata = read_header(filename)
            self._device = device
            shapes.saw(filename)

        def __enter__(self) -> SafeOpen:
            return self

        def __exit__(self, *_exc: Any) -> None:
            return None

        def keys(self) -> list[str]:
            return sorted(self._header)

        def offset_keys(self) -> list[str]:
            return sorted(self._header, key=lambda k: self._header[k]["data_offsets"][0])

        def metadata(self) -> dict[str, str]:
            return self._metadata

        def get_tensor(self, name: str) -> torch.Tensor:
            return _empty(self._header[name], self._device)

        def get_tensors(self) -> dict[str, torch.Tensor]:
            return {name: self.get_tensor(name) for name in self.offset_keys()}

        def get_slice(self, name: str) -> _Slice:
            return _Slice(self._header[name], self._device)

    return SafeOpen


def _load_file(shapes: CheckpointShapes) -> Callable[..., dict[str, torch.Tensor]]:
    def load_file(filename: Any, device: Any = "cpu", **_: Any) -> dict[str, torch.Tensor]:
        header, _ = read_header(filename)
        shapes.saw(filename)
        return {name: _empty(entry, device) for name, entry in header.items()}

    return load_file


def _torch_load(shapes: CheckpointShapes, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and "mmap" not in kwargs and _zip_archive(f):
            shapes.saw(f)
            return original(f, *args, mmap=True, **kwargs)
        return original(f, *args, **kwargs)

    return load


def _zip_archive(path: str | os.PathLike[str]) -> bool:
    """``torch.save``'s format since PyTorch 1.6 (the one ``mmap=True`` reads)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return torch.serialization._is_zipfile(f)


def _config_only(path: Any) -> bool:
    folder = Path(str(path))
    return (
        folder.is_dir()
        and (folder / "config.json").is_file()
        and not any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())
    )


def _from_pretrained(shapes: CheckpointShapes, original: Any) -> classmethod:
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(cls, name, *args, **kwargs)
        except OSError:
            if not _config_only(name):
                raise
        config = kwargs.get("config")
        if config is None or isinstance(config, (str, os.PathLike)):
            config = cls.config_class.from_pretrained(config or name)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        model = cls._from_config(
            config, **({"dtype": dtype} if dtype not in (None, "auto") else {})
        )
        shapes.from_config.append(str(name))
        return model.eval()

    return classmethod(from_pretrained)


def replace_everywhere(replacements: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """Every module attribute that is one of the originals (by id) -> its replacement
    (``from safetensors import safe_open`` bound the original under the importer's name);
    what was replaced, for restoring."""
    replaced: list[tuple[Any, str, Any]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in replacements and replacements[id(value)][0] is value:
                replaced.append((module, attr, value))
                setattr(module, attr, replacements[id(value)][1])
    return replaced


@contextlib.contextmanager
def weights_without_data() -> Iterator[CheckpointShapes]:
    """Checkpoint readers give shapes without data (module docstring) for as long as this is
    active; every reference to them is restored afterwards, those the program imported too."""
    shapes = CheckpointShapes()
    replacements: dict[int, tuple[Any, Any]] = {}
    torch_load = torch.load
    replacements[id(torch_load)] = (torch_load, _torch_load(shapes, torch_load))
    with contextlib.suppress(ImportError):
        import safetensors
        import safetensors.torch

        for original, fake in (
            (safetensors.safe_open, _safe_open_class(shapes)),
            (safetensors.torch.load_file, _load_file(shapes)),
        ):
            replacements[id(original)] = (original, fake)
    methods: list[tuple[Any, str, Any]] = []
    with contextlib.suppress(ImportError):
        modeling = importlib.import_module("transformers.modeling_utils")
        cls = modeling.PreTrainedModel
        original = cls.__dict__["from_pretrained"]
        methods.append((cls, "from_pretrained", original))
        cls.from_pretrained = _from_pretrained(shapes, original)
    replaced = replace_everywhere(replacements)
    synchronous = os.environ.get(SYNCHRONOUS_LOADING)
    os.environ[SYNCHRONOUS_LOADING] = "1"
    try:
        yield shapes
    finally:
        if synchronous is None:
            os.environ.pop(SYNCHRONOUS_LOADING, None)
        else:
            os.environ[SYNCHRONOUS_LOADING] = synchronous
        fakes = {id(fake): (fake, original) for original, fake in replacements.values()}
        replace_everywhere(fakes)
        for module, attr, value in reversed(replaced):
            setattr(module, attr, value)
        for owner, attr, value in methods:
            setattr(owner, attr, value)
