"""How deep a Hugging Face config says its model is, and a copy of the config at another depth
(the block extension, rehearsals and one-block shape checks build such copies)."""

from __future__ import annotations

import copy
from typing import Any

_DEPTH_ATTRS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""Config fields transformers' models read their layer count from (Llama/BERT, GPT-2, T5/GPT-J,
some remote-code models)."""


def config_depth(config: Any) -> int | None:
    """The number of layers a Hugging Face config declares, if it has one stack of them
    (encoder-decoder configs, with two, return None)."""
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    for attr in _DEPTH_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def shallow_config(config: Any, depth: int, length: int) -> Any:
    """A copy of a Hugging Face config with ``depth`` layers instead of ``length``."""
    out = copy.deepcopy(config)
    for attr in _DEPTH_ATTRS:
        if getattr(out, attr, None) == length:
            setattr(out, attr, depth)
    for attr in ("layer_types",):  # per-layer lists must shrink with the depth
        value = getattr(out, attr, None)
        if isinstance(value, list) and len(value) == length:
            setattr(out, attr, value[:depth])
    return out
