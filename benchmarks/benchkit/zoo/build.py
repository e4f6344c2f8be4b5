"""Building a case's model from its shrunk config, one plain training step, and the config.json variants."""

from __future__ import annotations

import json
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cases import Case, head_of
from .errors import _exc_line
from .settings import BATCH_SIZE, DTYPE_VARIANTS, MAX_PARAMETERS, SEQ_LEN
from .shrink import SHRINK_LEVELS, _is_int, make_config
from .shrink_keys import FORBIDDEN_PACKAGES, IMAGE_SIZE, MISSING_ATTRIBUTES, VOCAB


def _from_config(case: Case, config: Any) -> tuple[Any, str | None]:
    """The head's model from the config as vramledger builds it (the Auto class's
    ``from_config``); else the head's class itself, and why the Auto class failed."""
    import copy

    import transformers

    config = copy.deepcopy(config)
    if case.task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # as vramledger does
    auto = getattr(transformers, head_of(case.task).auto_class)
    try:
        model = auto.from_config(copy.deepcopy(config))
    except Exception as exc:
        try:
            model = getattr(transformers, case.class_name)(config)
        except Exception:
            raise exc from None
        return (
            model,
            f"{auto.__name__}.from_config failed ({_exc_line(exc)}); {case.class_name} built",
        )
    return model, None


def build_meta(case: Case, config: Any) -> tuple[int, str | None]:
    """Build the head's model on the meta device, weights not initialised (no memory); its
    parameter count (tied weights once), and a note if only the head's class builds it."""
    import torch

    from vramledger.inputs.sources import _hf_skip_init

    with torch.device("meta"), _hf_skip_init():
        model, note = _from_config(case, config)
        model.tie_weights()
    return sum({id(p): p.numel() for p in model.parameters()}.values()), note


PLAIN_TASKS = frozenset(
    {"causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "sequence-classification"}
)
"""Heads whose batch for the plain training step (``plain_step``) this script makes itself;
other heads get vramledger's own default batch (``vramledger.inputs.tasks``)."""


def _config_value(config: Any, name: str) -> Any:
    """``name`` from the config, else from its first sub-config that has it."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    for sub in getattr(config, "sub_configs", {}) or {}:
        value = getattr(getattr(config, sub, None), name, None)
        if value is not None:
            return value
    return None


def plain_batch(case: Case, config: Any) -> dict[str, Any]:
    """The batch vramledger's default inputs make for the task, from the config's own sizes
    (an image side or vocabulary held by a sub-config included)."""
    import torch

    b, s = BATCH_SIZE, SEQ_LEN
    if case.task not in PLAIN_TASKS or _unusual_images(case, config):
        return _vramledger_batch(case, config)
    if case.task == "image-classification":
        size = _config_value(config, "image_size") or IMAGE_SIZE
        h, w = (size, size) if _is_int(size) else size[:2]
        channels = _config_value(config, "num_channels") or 3
        return {
            "pixel_values": torch.randn(b, channels, h, w),
            "labels": torch.randint(0, config.num_labels, (b,)),
        }
    vocab = _config_value(config, "vocab_size") or VOCAB
    ids = torch.randint(0, vocab, (b, s))
    if case.task == "sequence-classification":
        return {"input_ids": ids, "labels": torch.randint(0, config.num_labels, (b,))}
    return {"input_ids": ids, "labels": torch.randint(0, vocab, (b, s))}


def _unusual_images(case: Case, config: Any) -> bool:
    """Image classifiers that take no image tensor of (batch, channels, height, width): patches
    cut by their processor (SigLIP 2) or one token per pixel (ImageGPT); vramledger's default
    batch makes them (``vramledger.inputs.tasks.image_input``)."""
    if case.task != "image-classification":
        return False
    import transformers

    try:
        from vramledger.inputs.tasks import image_input
    except ImportError:
        return False
    return image_input(config, getattr(transformers, case.class_name, None)) != "pixels"


def _can_feed(task: str) -> bool:
    """Whether ``plain_batch`` can make a batch for the task."""
    if task in PLAIN_TASKS:
        return True
    try:
        from vramledger.inputs.tasks import KINDS
    except ImportError:
        return False
    return task in KINDS


def _vramledger_batch(case: Case, config: Any) -> dict[str, Any]:
    import torch
    import transformers

    from vramledger.inputs.sources import BatchShape
    from vramledger.inputs.tasks import KINDS, model_class

    shape = BatchShape(batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
    cls = model_class(config, case.task) or getattr(transformers, case.class_name)
    return KINDS[case.task].make(config, cls, torch.device("cpu"), shape)


def plain_step(case: Case, config: Any) -> dict[str, Any] | None:
    """One real forward and backward of the head's model built from ``config`` with plain
    transformers and PyTorch (no vramledger), on the batch of ``plain_batch``: None if it
    trains, else the error. Tells a config (or model) that cannot train at all from a failure
    of vramledger's."""
    import torch

    from vramledger.inputs.errors import VramledgerError

    torch.manual_seed(0)
    try:
        batch = plain_batch(case, config)
    except VramledgerError:
        return None  # vramledger has no default batch for it: nothing to check the model with
    try:
        model, _ = _from_config(case, config)
        model.train()
        loss = model(**batch).loss
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{type(model).__name__} returned no loss")
        loss.backward()
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        return {
            "type": type(exc).__name__,
            "message": _exc_line(exc)[:600],
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames],
        }
    return None


def _decoder_start_token_id(config: Any) -> int | None:
    """The decoder start token of an encoder-decoder config whose defaults lack one (T5's:
    checkpoints give it; the model reads it to shift the labels right): the pad token, else 0.
    None when it has one."""
    if not getattr(config, "is_encoder_decoder", False):
        return None
    if getattr(config, "decoder_start_token_id", None) is not None:
        return None
    pad = getattr(config, "pad_token_id", None)
    return pad if pad is not None else 0


PAD_TOKEN_WANTED = "pad_token_id has to be defined"
"""transformers' ``shift_tokens_right`` error when a seq2seq config has no pad token (a
checkpoint's config.json has one)."""


def _pad_token_id(config: Any) -> int:
    """A pad token for a config whose defaults lack one: its end-of-sequence token (what many
    checkpoints pad with), else 0."""
    eos = getattr(config, "eos_token_id", None)
    return eos if isinstance(eos, int) else 0


class BuildSkip(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Built:
    config: Any
    parameters: int
    level: str
    """The shrink level used (``SHRINK_LEVELS``)."""
    attempts: list[str]
    """Why earlier levels were not used, and what was added to the config."""
    plain_step_error: dict[str, Any] | None = None
    """Set when no level's model trains in a plain PyTorch step (``plain_step``)."""


def build_case(case: Case, check_step: bool = True) -> Built:
    """The first shrink level whose config builds the head's model with at most
    ``MAX_PARAMETERS`` parameters and (``check_step``) trains in a plain PyTorch step; if none
    trains, the first that builds, with the step's error. Raises ``BuildSkip`` (with the
    reason) when no level builds."""
    if case.arch in FORBIDDEN_PACKAGES:
        raise BuildSkip(
            "needs a package not used here",
            f"{case.arch} wraps {FORBIDDEN_PACKAGES[case.arch]} (breaks with this torch)",
        )
    attempts: list[str] = []
    failures: dict[str, BaseException] = {}
    default_params = None
    untrained: Built | None = None
    for level in SHRINK_LEVELS:
        extra: dict[str, Any] = {}
        while True:
            try:
                config = make_config(case.arch, level, extra)
                params, note = build_meta(case, config)
                break
            except Exception as exc:
                missing = re.search(r"has no attribute '(\w+)'", str(exc))
                name = missing.group(1) if missing else None
                if name in MISSING_ATTRIBUTES and name not in extra:
                    extra[name] = MISSING_ATTRIBUTES[name]
                    continue
                failures[level.name] = exc
                attempts.append(f"{level.name}: {_exc_line(exc)}")
                params = None
                break
        if params is None:
            continue
        if level.layers is None:
            default_params = params
        if params > MAX_PARAMETERS:
            attempts.append(f"{level.name}: {params:,} parameters > {MAX_PARAMETERS:,}")
            continue
        start_id = _decoder_start_token_id(config)
        if start_id is not None:
            extra["decoder_start_token_id"] = start_id
            config = make_config(case.arch, level, extra)
        if extra:
            attempts.append(f"{level.name}: added {extra} (the defaults lack them)")
        if note:
            attempts.append(f"{level.name}: {note}")
        error = plain_step(case, config) if check_step and _can_feed(case.task) else None
        if (
            error is not None
            and PAD_TOKEN_WANTED in error["message"]
            and "pad_token_id" not in extra
        ):
            # the defaults lack the pad token that shifting the labels right reads (Moonshine)
            extra["pad_token_id"] = _pad_token_id(config)
            config = make_config(case.arch, level, extra)
            attempts.append(
                f"{level.name}: added pad_token_id {extra['pad_token_id']} (a plain step wants one)"
            )
            error = plain_step(case, config)
        if error is None:
            return Built(config, params, level.name, attempts)
        attempts.append(f"{level.name}: plain step: {error['message']}")
        untrained = untrained or Built(config, params, level.name, [], error)
    if untrained is not None:
        untrained.attempts = attempts
        return untrained
    if any(isinstance(e, ImportError) for e in failures.values()):
        exc = next(e for e in failures.values() if isinstance(e, ImportError))
        raise BuildSkip("needs a package not installed", _exc_line(exc))
    if default_params is not None:
        raise BuildSkip("config cannot be shrunk", "; ".join(attempts))
    raise BuildSkip(
        "the defaults do not build (transformers)", f"defaults: {_exc_line(failures['defaults'])}"
    )


def write_variants(config: Any, folder: Path) -> dict[str, Path]:
    """config.json as ``save_pretrained`` writes it, without and with a declared dtype."""
    import torch

    paths = {}
    for variant in DTYPE_VARIANTS:
        where = folder / variant
        config.dtype = None if variant == "none" else getattr(torch, variant)
        config.save_pretrained(where)
        path = where / "config.json"
        data = json.loads(path.read_text())
        declared = data.get("dtype")
        expected = None if variant == "none" else variant
        if declared != expected:
            raise RuntimeError(f"save_pretrained wrote dtype {declared!r} for variant {variant}")
        paths[variant] = path
    config.dtype = None
    return paths
