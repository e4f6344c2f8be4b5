"""The Hugging Face Hub, offline, for a program run with CUDA emulated.

``vramledger run`` downloads nothing: ``HF_HUB_OFFLINE=1`` is set while the program runs (in the
environment, and in ``huggingface_hub.constants``, which read it at import). A file in the
local cache still loads; one that is not makes huggingface_hub raise ``LocalEntryNotFoundError``
(or ``OfflineModeIsEnabled``), which transformers wraps in an ``OSError`` that names neither
the repository nor the file. So ``hf_hub_download`` and ``snapshot_download`` (the functions,
wherever the program's libraries imported them, and ``HfApi``'s methods) record what each
refused (:class:`OfflineHub`), and :meth:`OfflineHub.refusal` turns the program's exception,
where a refusal caused it, into vramledger's one-line error naming the repository and file.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vramledger.inputs.checkpoint_shapes import replace_everywhere
from vramledger.inputs.errors import InputError

OFFLINE_VARIABLE = "HF_HUB_OFFLINE"


@dataclass(kw_only=True)
class OfflineHub:
    """The downloads refused while :func:`offline_hub` was active."""

    refused: list[tuple[BaseException, str]] = field(default_factory=list)
    """Each refusal's exception and what was asked (``repo/file`` or ``repo (snapshot)``)."""

    def refusal(self, exc: BaseException) -> InputError | None:
        """vramledger's error for ``exc`` where a refused download is in its chain, else None."""
        seen: set[int] = set()
        chain = exc
        while chain is not None and id(chain) not in seen:
            seen.add(id(chain))
            for refused, asked in self.refused:
                if refused is chain:
                    return InputError(
                        f"the program needed {asked} from the Hugging Face Hub, which is not in "
                        "the local cache (vramledger run downloads nothing)",
                        hint="download it first (`hf download REPO`) or give the program a "
                        "local folder",
                    )
            chain = chain.__cause__ or chain.__context__
        return None


def _recording(hub: OfflineHub, original: Callable[..., Any], snapshot: bool) -> Callable[..., Any]:
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    @functools.wraps(original)
    def download(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
            values = list(args)
            if values and not isinstance(values[0], str):
                values.pop(0)  # HfApi's self
            repo = kwargs.get("repo_id", values[0] if values else "?")
            if snapshot:
                asked = f"{repo} (a snapshot of the repository)"
            else:
                filename = kwargs.get("filename", values[1] if len(values) > 1 else "?")
                subfolder = kwargs.get("subfolder")
                asked = f"{repo}/{subfolder + '/' if subfolder else ''}{filename}"
            hub.refused.append((exc, asked))
            raise

    return download


@contextlib.contextmanager
def offline_hub() -> Iterator[OfflineHub]:
    """The Hub offline, and its refusals recorded, for as long as this is active."""
    hub = OfflineHub()
    saved = os.environ.get(OFFLINE_VARIABLE)
    os.environ[OFFLINE_VARIABLE] = "1"
    restore: list[tuple[Any, str, Any]] = []
    fakes: dict[int, tuple[Any, Any]] = {}
    try:
        hf = importlib.import_module("huggingface_hub")
    except ImportError:
        hf = None
    if hf is not None:
        constants = importlib.import_module("huggingface_hub.constants")
        restore.append((constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE))
        constants.HF_HUB_OFFLINE = True
        for name, snapshot in (("hf_hub_download", False), ("snapshot_download", True)):
            original = getattr(hf, name)
            fakes[id(original)] = (original, _recording(hub, original, snapshot))
            method = hf.HfApi.__dict__.get(name)
            if method is not None:
                restore.append((hf.HfApi, name, method))
                setattr(hf.HfApi, name, _recording(hub, method, snapshot))
    replaced = replace_everywhere(fakes)
    try:
        yield hub
    finally:
        replace_everywhere({id(fake): (fake, original) for original, fake in fakes.values()})
        for module, attr, value in reversed(replaced):
            setattr(module, attr, value)
        for owner, attr, value in reversed(restore):
            setattr(owner, attr, value)
        if saved is None:
            os.environ.pop(OFFLINE_VARIABLE, None)
        else:
            os.environ[OFFLINE_VARIABLE] = saved
