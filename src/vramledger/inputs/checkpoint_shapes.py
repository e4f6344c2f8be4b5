"""Checkpoints read as shapes, without their data, for a program run with CUDA emulated.

A program that loads a checkpoint needs its tensors' shapes and dtypes, never their values
(what it puts on "cuda" is a fake tensor). So, while :func:`weights_without_data` is active:

- ``safetensors.torch.load_file`` and ``safetensors.safe_open(...).get_tensor / get_slice``
  read the file's header only (8 bytes little-endian: the header's length, then JSON naming
  each tensor's dtype, shape and data offsets; https://github.com/huggingface/safetensors)
  and give uninitialised tensors of those shapes and dtypes (``torch.empty``: host pages that
  are never written stay unmapped, so a 2 GiB file costs no resident memory), on the device
  asked for (on "cuda" they are emulated, fake tensors);
- ``torch.load`` of a file ``torch.save`` wrote (a zip archive) maps it (``mmap=True``, also
  where the program asked for ``mmap=False``: torchtune reads its recipe state so) instead of
  reading it: no page is read unless the program reads its values. A file in the format before
  PyTorch 1.6 (``_use_new_zipfile_serialization=False``: pickles, then each storage's bytes)
  cannot be mapped; it is read under ``torch.serialization.skip_data``, which rebuilds every
  tensor, view and shared storage from the pickles and stops before the bytes (uninitialised
  storages, as for safetensors). The tar format of PyTorch before 0.4 keeps each storage's
  size beside its bytes, read together (``torch.serialization._legacy_load``'s
  ``legacy_load``): refused in one line;
- Lightning's lazy loader (``lightning.fabric.utilities.load._lazy_load``, with which LitGPT
  reads ``lit_model.pth``: ``litgpt.utils.load_checkpoint``) reads a tensor's bytes from the
  archive when it is first used; it maps the file instead, as ``torch.load`` does;
- ``from_pretrained`` of transformers' models on a local folder with only ``config.json``
  builds the model from its config, with random weights, instead of raising ``OSError``; given
  a ``quantization_config`` or a ``device_map``, ``from_pretrained`` loads uninitialised
  weights of the config's shapes (a state dict), so its quantizer and device map apply.

Each load is listed (:attr:`CheckpointShapes.read`) for the notes. ``--measure`` (a real run)
reads checkpoints for real; this module is not active there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import os
import struct
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from vramledger.inputs.errors import InputError
from vramledger.inputs.import_hooks import when_imported

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

LIGHTNING_LAZY_LOAD = (
    "lightning.fabric.utilities.load",
    "lightning_fabric.utilities.load",
)
"""Where Lightning's ``_lazy_load`` lives (the ``lightning`` package and the standalone
``lightning_fabric`` one); ``litgpt.utils`` binds it as ``lazy_load``."""

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
        kind = saved_format(f)
        if kind == "zip" and isinstance(f, (str, os.PathLike)):
            shapes.saw(f)
            return original(f, *args, **{**kwargs, "mmap": True})
        if kind == "legacy" and not kwargs.get("mmap"):
            shapes.saw(_name_of(f))
            with torch.serialization.skip_data():
                return original(f, *args, **kwargs)
        if kind == "tar":
            raise InputError(
                f"{_name_of(f)} is in torch.save's tar format (PyTorch before 0.4), whose "
                "storage sizes are read together with their bytes: its shapes cannot be had "
                "without reading all its data",
                hint="load and save it again with a current PyTorch (torch.save), then rerun",
            )
        return original(f, *args, **kwargs)

    return load


Format = Literal["zip", "legacy", "tar"]


def saved_format(f: Any) -> Format | None:
    """Which of ``torch.save``'s formats a file (a path or a seekable binary file) holds: "zip"
    (since PyTorch 1.6, the one ``mmap=True`` reads), "tar" (before 0.4) or "legacy" (the
    pickles between them); None for anything else (a missing file, an in-memory buffer)."""
    if isinstance(f, (str, os.PathLike)):
        if not os.path.isfile(f):
            return None
        with open(f, "rb") as opened:
            return saved_format(opened)
    if not all(hasattr(f, a) for a in ("read", "seek", "tell")) or isinstance(f, io.BytesIO):
        return None
    start = f.tell()
    try:
        if torch.serialization._is_zipfile(f):
            return "zip"
        f.seek(start)
        if tarfile.is_tarfile(f):
            return "tar"
        f.seek(start)
        return "legacy" if f.read(2) == PICKLE_PROTOCOL_2 else None
    finally:
        f.seek(start)


PICKLE_PROTOCOL_2 = b"\x80\x02"
"""How the legacy format opens: its magic number pickled with protocol 2 (``torch.save``'s
``DEFAULT_PROTOCOL``)."""


def _name_of(f: Any) -> str:
    return str(getattr(f, "name", f))


def _lazy_load(shapes: CheckpointShapes, original: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's ``_lazy_load``: the archive mapped (``torch.load(mmap=True)``, every tensor
    a view of the file, no page read) instead of a reader that copies a record out on first
    use. The result is the same state dict of the same tensors."""

    @functools.wraps(original)
    def lazy_load(filename: Any) -> Any:
        if saved_format(filename) != "zip":
            return original(filename)
        shapes.saw(filename)
        return torch.load(filename, mmap=True, weights_only=False, map_location="cpu")

    return lazy_load


LOADING_OPTIONS = ("quantization_config", "device_map")
"""``from_pretrained`` options that a model built from its config would not honour: a folder
with only ``config.json`` is then loaded by ``from_pretrained`` itself, from a state dict."""


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
        as_dtype = {"dtype": dtype} if dtype not in (None, "auto") else {}
        if any(kwargs.get(k) is not None for k in LOADING_OPTIONS):
            # from_pretrained's own loading, of uninitialised weights of the config's shapes
            # (as a weights file is read here): the quantizer and device map apply
            with torch.device("meta"):
                built = cls._from_config(config, **as_dtype)
            weights = {
                k: torch.empty(v.shape, dtype=v.dtype) for k, v in built.state_dict().items()
            }
            rest = {k: v for k, v in kwargs.items() if k != "config"}
            model = function(cls, None, *args, config=config, state_dict=weights, **rest)
        else:
            model = cls._from_config(config, **as_dtype)
        shapes.from_config.append(str(name))
        return model.eval()

    return classmethod(from_pretrained)


def _lazy_loads_replaced(
    shapes: CheckpointShapes,
    replacements: dict[int, tuple[Any, Any]],
    imports: contextlib.ExitStack,
) -> None:
    """Lightning's ``_lazy_load`` (``LIGHTNING_LAZY_LOAD``) entered in ``replacements`` where
    imported, else replaced when the program imports it (before ``litgpt.utils`` binds it):
    the import hooks waiting are entered on ``imports``, removed when it closes."""

    def replace(module: ModuleType) -> None:
        original = getattr(module, "_lazy_load", None)
        if original is not None and id(original) not in replacements:
            replacements[id(original)] = (original, _lazy_load(shapes, original))
            module._lazy_load = replacements[id(original)][1]  # type: ignore[attr-defined]

    for module_name in LIGHTNING_LAZY_LOAD:
        module = sys.modules.get(module_name)
        if module is not None:
            original = getattr(module, "_lazy_load", None)
            if original is not None:
                replacements[id(original)] = (original, _lazy_load(shapes, original))
        else:
            imports.enter_context(when_imported(module_name, replace))


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
    imports = contextlib.ExitStack()
    _lazy_loads_replaced(shapes, replacements, imports)
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
        imports.close()
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
