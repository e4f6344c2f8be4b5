"""Shrinking a config class's defaults to a small model of the same architecture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .settings import SEQ_LEN
from .shrink_keys import (
    AUDIO_CONV_DIM,
    AUDIO_CONV_KEYS,
    AXIAL_ROWS,
    BACKBONE_KEYS,
    CHUNK,
    CHUNK_KEYS,
    COMPOSITE_DEFAULTS,
    EXPERT_KEYS,
    EXPERTS,
    EXPERTS_PER_TOKEN,
    FFN_KEY,
    FILTER_KEYS,
    FILTERS,
    GROUPS,
    GROUPS_KEY,
    HEAD_DIM,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HIDDEN,
    IMAGE_SIZE,
    INTERMEDIATE,
    KV_HEAD_KEYS,
    KV_HEADS,
    LAYER_INDEX_KEY,
    LAYER_KEYS,
    LAYERS,
    LAYERS_RETRY,
    LORA_RANK,
    LORA_RANK_KEYS,
    NONE_FILLED,
    NUM_HEADS,
    ONE_KEYS,
    PATCH_SIZE,
    PER_LAYER_KEYS,
    PERIOD_KEYS,
    POSITION_KEYS,
    POSITIONS,
    ROPE_HEAD_DIM,
    ROPE_HEAD_DIM_KEYS,
    ROPE_KEYS,
    SCALE,
    SCALE_KEYS,
    STAGE_DEPTH,
    STAGE_DEPTH_KEYS,
    STAGE_HEAD_KEYS,
    STAGE_WIDTH,
    STAGE_WIDTH_KEYS,
    SUB_LAYER_KEYS,
    TOKEN_ID_KEY,
    TOP_K_KEYS,
    VOCAB,
    VOCAB_KEY,
    WIDTH_KEY,
    ZERO_KEYS,
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(v) for v in value)


def _category(key: str) -> str | None:
    """What an integer attribute sizes (the tables above, in order)."""
    for category, keys in (
        ("layers", LAYER_KEYS),
        ("sub_layers", SUB_LAYER_KEYS),
        ("period", PERIOD_KEYS),
        ("zero", ZERO_KEYS),
        ("kv_heads", KV_HEAD_KEYS),
        ("heads", HEAD_KEYS),
        ("rope_head_dim", ROPE_HEAD_DIM_KEYS),
        ("head_dim", HEAD_DIM_KEYS),
    ):
        if key in keys:
            return category
    if FFN_KEY.search(key):
        return "ffn"
    if WIDTH_KEY.search(key):
        return "width"
    for category, keys in (
        ("positions", POSITION_KEYS),
        ("experts", EXPERT_KEYS),
        ("top_k", TOP_K_KEYS),
        ("one", ONE_KEYS),
        ("lora_rank", LORA_RANK_KEYS),
        ("chunk", CHUNK_KEYS),
        ("filters", FILTER_KEYS),
    ):
        if key in keys:
            return category
    if GROUPS_KEY.search(key):
        return "groups"
    if TOKEN_ID_KEY.search(key):
        return "token_id"
    if VOCAB_KEY.search(key):
        return "vocab"
    if key in ("image_size", "patch_size"):
        return key
    return None


DEPTH_ONLY = frozenset(
    {
        "layers",
        "sub_layers",
        "zero",
        "positions",
        "experts",
        "top_k",
        "one",
        "vocab",
        "token_id",
        "image_size",
        "chunk",
    }
)
"""The categories a ``depth``-level shrink changes (widths stay the defaults)."""


@dataclass(frozen=True)
class Level:
    name: str
    layers: int | None
    """None: the defaults, unshrunk."""
    categories: frozenset[str] | None = None
    """None: every category."""


SHRINK_LEVELS = (
    Level("full", LAYERS),
    Level(f"full, {LAYERS_RETRY} layers", LAYERS_RETRY),
    Level("depth only", LAYERS, DEPTH_ONLY),
    Level("defaults", None),
)
"""Tried in order until the model builds with at most ``MAX_PARAMETERS`` parameters."""


class TokenIds:
    """Maps special token ids beyond the shrunk vocabulary to distinct ids inside it (the same
    original id to the same new id at every level of a composite config)."""

    def __init__(self) -> None:
        self.mapping: dict[int, int] = {}

    def __call__(self, value: int) -> int:
        if value < VOCAB:
            return value
        if value not in self.mapping:
            self.mapping[value] = VOCAB - 1 - len(self.mapping)
        return self.mapping[value]


def _pick_layers(kinds: list[Any], count: int) -> list[int]:
    """``count`` layer indices, taking the kinds of layer in turn (in the order they first
    appear), so a hybrid model keeps each kind, and two of a kind where there is room."""
    by_kind: dict[Any, list[int]] = {}
    for i, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(i)
    picked: list[int] = []
    while len(picked) < min(count, len(kinds)):
        for indices in by_kind.values():
            if indices and len(picked) < count:
                picked.append(indices.pop(0))
    return sorted(picked)


def _per_layer(data: dict[str, Any], count: int) -> list[str]:
    """Keys of per-layer lists (and pattern strings) of length ``count``."""
    return [
        k
        for k, v in data.items()
        if (isinstance(v, list) or (isinstance(v, str) and k in PER_LAYER_KEYS))
        and len(v) == count
        and k not in STAGE_DEPTH_KEYS | STAGE_WIDTH_KEYS | STAGE_HEAD_KEYS | BACKBONE_KEYS
    ]


def shrink(
    data: dict[str, Any], level: Level = SHRINK_LEVELS[0], ids: TokenIds | None = None
) -> dict[str, Any]:
    """A config dict (``config.to_dict()``) made small by the tables above, at every level of
    nested sub-configs: per-layer lists cut to the layers kept (each kind of layer kept),
    widths divisible by head counts, special token ids inside the vocabulary."""
    if level.layers is None:
        return dict(data)
    ids = ids if ids is not None else TokenIds()
    layers = level.layers
    wanted = level.categories
    out = {k: v for k, v in data.items() if k not in BACKBONE_KEYS}
    done: set[str] = set()
    stage_list = next((v for k, v in data.items() if k in STAGE_DEPTH_KEYS and _int_list(v)), None)
    stage_heads = next((v for k, v in data.items() if k in STAGE_HEAD_KEYS and _int_list(v)), None)
    new_stage_heads = [max(1, h // max(1, stage_heads[0])) for h in stage_heads or []] or None
    heads = next((v for k, v in data.items() if k in HEAD_KEYS and _is_int(v)), None)

    # Layer counts, and the per-layer lists (and per-layer dicts) that follow them.
    counts = {
        v
        for k, v in data.items()
        if k in LAYER_KEYS
        and _is_int(v)
        and v > layers
        and not (stage_list and v == len(stage_list))
    }
    if not counts:
        counts = {len(v) for k, v in data.items() if k in PER_LAYER_KEYS and v and len(v) > layers}
    parts = _layer_parts(data, counts)
    if parts:
        for k in parts:
            out[k] = min(data[k], 1)
        done |= set(parts)
    for count in counts:
        kept = (
            sum(out[k] for k in parts) if parts and sum(data[k] for k in parts) == count else layers
        )
        if kept != layers:
            for k in LAYER_KEYS & data.keys():
                if data[k] == count:
                    out[k] = kept
                    done.add(k)
        keys = _per_layer(data, count)
        kinds = [json.dumps([data[k][i] for k in keys], default=str) for i in range(count)]
        picked = _pick_layers(kinds, kept)
        for k in keys:
            values = [data[k][i] for i in picked]
            out[k] = "".join(values) if isinstance(data[k], str) else values
            done.add(k)
        for k, v in data.items():
            if k in keys or k in done:
                continue
            if LAYER_INDEX_KEY.search(k) and _int_list(v) and all(0 <= i < count for i in v):
                out[k] = [new for new, old in enumerate(picked) if old in v] or [len(picked) - 1]
                done.add(k)
            if "layer" in k and isinstance(v, dict) and v and all(i.isdigit() for i in v):
                out[k] = {
                    str(new): shrink(v[str(old)], level, ids)
                    if isinstance(v[str(old)], dict)
                    else v[str(old)]
                    for new, old in enumerate(picked)
                    if str(old) in v
                }
                done.add(k)

    for key, value in data.items():
        if key in done or key in BACKBONE_KEYS:
            continue
        if isinstance(value, dict):
            if "model_type" in value:
                out[key] = shrink(value, level, ids)
            elif key in ROPE_KEYS and wanted is None:
                out[key] = _shrink_rope(value)
            continue
        if _int_list(value):
            out[key] = _shrink_int_list(key, value, new_stage_heads, ids, wanted)
            continue
        if value is None and key in NONE_FILLED and wanted is None:
            out[key] = NONE_FILLED[key] or (_heads(heads) if heads else None)
            continue
        if isinstance(value, float) and key in SCALE_KEYS and wanted is None:
            out[key] = min(value, SCALE)
            continue
        if not _is_int(value):
            continue
        category = _category(key)
        if category is None or (wanted is not None and category not in wanted):
            continue
        if category == "layers":
            if not (stage_list and value == len(stage_list)):
                out[key] = min(value, layers)
        elif category == "sub_layers":
            out[key] = min(value, layers - 1)
        elif category == "period":
            out[key] = min(value, layers)
        elif category == "zero":
            out[key] = 0
        elif category == "width":
            if stage_list and key == "embed_dim":
                out[key] = HEAD_DIM * new_stage_heads[0] if new_stage_heads else STAGE_WIDTH
            else:
                out[key] = min(value, HIDDEN)
        elif category == "heads":
            out[key] = _heads(value)
        elif category == "kv_heads":
            out[key] = 1 if value == 1 else _heads(heads) if heads and value >= heads else KV_HEADS
        elif category == "token_id":
            out[key] = ids(value)
        else:
            out[key] = min(value, _TARGETS[category])
    if wanted is None:
        _make_consistent(data, out)
    return out


def _heads(value: int) -> int:
    return NUM_HEADS if value > NUM_HEADS or HIDDEN % value else value


_TARGETS = {
    "rope_head_dim": ROPE_HEAD_DIM,
    "head_dim": HEAD_DIM,
    "ffn": INTERMEDIATE,
    "positions": POSITIONS,
    "experts": EXPERTS,
    "top_k": EXPERTS_PER_TOKEN,
    "one": 1,
    "lora_rank": LORA_RANK,
    "groups": GROUPS,
    "chunk": CHUNK,
    "filters": FILTERS,
    "vocab": VOCAB,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
}


def _layer_parts(data: dict[str, Any], counts: set[int]) -> list[str]:
    """Layer counts given as parts that add up to a total (input, recurrent and output layers):
    each part is then cut to one layer and the total is their sum."""
    parts = [
        k
        for k, v in data.items()
        if _is_int(v) and "layers" in k and k not in LAYER_KEYS | SUB_LAYER_KEYS | ZERO_KEYS
    ]
    if len(parts) >= 2 and sum(data[k] for k in parts) in counts:
        return parts
    return []


def _shrink_int_list(
    key: str,
    value: list[int],
    stage_heads: list[int] | None,
    ids: TokenIds,
    wanted: frozenset[str] | None,
) -> list[int]:
    if TOKEN_ID_KEY.search(key):
        return [ids(v) for v in value]
    if key == "image_size":
        return [min(v, IMAGE_SIZE) for v in value]
    if wanted is not None:
        return [min(v, STAGE_DEPTH) for v in value] if key in STAGE_DEPTH_KEYS else value
    if key in STAGE_HEAD_KEYS and stage_heads is not None:
        return stage_heads
    if key in STAGE_DEPTH_KEYS:
        return [min(v, STAGE_DEPTH) for v in value]
    if key in STAGE_WIDTH_KEYS:
        if stage_heads is not None and len(stage_heads) == len(value):
            return [HEAD_DIM * h for h in stage_heads]
        return [min(v, STAGE_WIDTH * 2**i) for i, v in enumerate(value)]
    if key in AUDIO_CONV_KEYS:
        return [min(v, AUDIO_CONV_DIM) for v in value]
    return value


def _shrink_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """Rotary parameters whose lengths follow the head width (mrope sections, long/short
    factors) made to follow the shrunk head width."""
    out = dict(rope)
    half = HEAD_DIM // 2
    if _int_list(rope.get("mrope_section")):
        sections = rope["mrope_section"]
        total = sum(sections)
        scaled = [max(1, s * half // total) for s in sections]
        scaled[0] += half - sum(scaled)
        out["mrope_section"] = scaled
    for key in ("long_factor", "short_factor"):
        if isinstance(rope.get(key), list):
            out[key] = rope[key][:half]
    if _is_int(rope.get("original_max_position_embeddings")):
        out["original_max_position_embeddings"] = min(
            rope["original_max_position_embeddings"], POSITIONS
        )
    return out


def _make_consistent(data: dict[str, Any], out: dict[str, Any]) -> None:
    """Constraints between shrunk values that config classes check or model code assumes
    (``data``: the values before shrinking)."""
    if {"qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"} <= out.keys():
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    # Multi-head latent attention: the rotary part's width is ``head_dim`` where they were equal.
    if _is_int(data.get("head_dim")) and data.get("head_dim") == data.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]
    hidden = out.get("hidden_size")
    # Widths given as multiples of the hidden width (Zamba's concatenated attention input).
    for key, per_head in (("attention_hidden_size", "attention_head_dim"),):
        old_hidden, old = data.get("hidden_size"), data.get(key)
        if _is_int(hidden) and _is_int(old_hidden) and _is_int(old) and old % old_hidden == 0:
            out[key] = old // old_hidden * hidden
            heads = out.get("num_attention_heads")
            if _is_int(out.get(per_head)) and _is_int(heads):
                out[per_head] = out[key] // heads
    # Swin-style stages: the window is the last stage's resolution (as 224-pixel images with
    # 7-pixel windows have), so every stage's window is whole.
    depths = next((v for k, v in out.items() if k in STAGE_DEPTH_KEYS and _int_list(v)), None)
    if depths and all(_is_int(out.get(k)) for k in ("window_size", "image_size", "patch_size")):
        last = out["image_size"] // out["patch_size"] // 2 ** (len(depths) - 1)
        out["window_size"] = max(1, min(out["window_size"], last))
    # EfficientNet: the head's width follows the width multiplier.
    if isinstance(data.get("width_coefficient"), float) and _is_int(data.get("hidden_dim")):
        out["hidden_dim"] = round(
            data["hidden_dim"] * out["width_coefficient"] / data["width_coefficient"]
        )
    if _is_int(out.get("mamba_d_ssm")) and _is_int(out.get("mamba_expand")) and _is_int(hidden):
        out["mamba_d_ssm"] = out["mamba_expand"] * hidden
    # Mamba: heads x head width = expand x hidden.
    for n_heads, d_head, expand in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("num_heads", "head_dim", "expand"),
    ):
        mamba = "state_size" in out or n_heads.startswith("mamba")
        if (
            mamba
            and _is_int(hidden)
            and all(_is_int(out.get(k)) for k in (n_heads, d_head, expand))
        ):
            inner = out.get("mamba_d_ssm") or out[expand] * hidden
            out[n_heads] = max(1, inner // out[d_head])
    # Axial position embeddings (Reformer): the factors sum to the width and multiply to the
    # sequence length.
    if _int_list(out.get("axial_pos_embds_dim")) and _is_int(hidden):
        out["axial_pos_embds_dim"] = [hidden // 2, hidden - hidden // 2]
    if _int_list(out.get("axial_pos_shape")):
        out["axial_pos_shape"] = [AXIAL_ROWS, SEQ_LEN // AXIAL_ROWS]
        out["max_position_embeddings"] = SEQ_LEN


def default_config_dict(arch: str) -> dict[str, Any]:
    """The config class's defaults as a dict (composite configs from their usual parts)."""
    import transformers

    if arch in COMPOSITE_DEFAULTS:
        parts = {
            name: transformers.CONFIG_MAPPING[sub]().to_dict()
            for name, sub in COMPOSITE_DEFAULTS[arch].items()
        }
        if "decoder" in parts:
            parts["decoder"].update(is_decoder=True, add_cross_attention=True)
        # The composite has no token ids of its own; users set these (the model shifts the
        # labels right with them).
        return {"model_type": arch, "pad_token_id": 0, "decoder_start_token_id": 0, **parts}
    return transformers.CONFIG_MAPPING[arch]().to_dict()


def make_config(arch: str, level: Level = SHRINK_LEVELS[0], extra: dict | None = None) -> Any:
    """The config object of ``arch`` shrunk at ``level`` (plus ``extra`` attributes)."""
    import transformers

    data = _keep_every_layer(shrink(default_config_dict(arch), level))
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        data.pop(key, None)
    data.update(extra or {})
    return transformers.CONFIG_MAPPING[arch](**data)


LAYERDROP_SUFFIX = "layerdrop"
"""Config keys of LayerDrop probabilities (``layerdrop``, ``encoder_layerdrop``,
``decoder_layerdrop``, ``speech_encoder_layerdrop``): set to 0 in the zoo's configs. An estimate
answers the draws at the top of their range (every layer kept: the most memory any step of the
run takes, with every layer's gradients and optimizer state); one real step drops layers at
random (m2m_100's measured 8 % below it, its dropped layer's gradients and AdamW state
missing), so a comparison with it would test the dice, not the accounting."""


def _keep_every_layer(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every LayerDrop probability, at any nesting level, set to 0."""
    return {
        k: _keep_every_layer(v)
        if isinstance(v, dict)
        else (0.0 if isinstance(k, str) and k.endswith(LAYERDROP_SUFFIX) and v else v)
        for k, v in data.items()
    }
