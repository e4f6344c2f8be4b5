"""Sweep the transformers model zoo: every architecture's estimate against its real CPU run.

    python benchmarks/zoo.py                       # everything, 2 workers (~1 h on 2 cores)
    python benchmarks/zoo.py --sample 12 --no-distributed      # a deterministic sample (CI)
    python benchmarks/zoo.py --only llama,bert --tasks causal-lm,masked-lm
    python benchmarks/zoo.py --precisions fp32,bf16-master --dtype-variants none
    python benchmarks/zoo.py --retriage benchmarks/results/zoo-DATE-HOST.json   # no runs

Every model type of the installed transformers with a causal-LM, masked-LM, seq2seq-LM,
image-classification, sequence-classification or audio (audio classification, CTC, speech
seq2seq) head in transformers' own auto mappings (``--tasks token-classification,
image-text-to-text`` adds those) is built from its config class's defaults, shrunk generically
(2 layers, width 64, 4 heads, feed-forward 128, vocabulary 1024, 4 experts, 64-pixel images;
``shrink``; LayerDrop off, ``LAYERDROP_SUFFIX``), and saved as transformers saves it
(``save_pretrained``) twice: with a declared checkpoint dtype (``"dtype": "bfloat16"``) and
without one. For each precision and config variant,
``vramledger.estimate(model=config.json, task=HEAD, target="cpu")`` of the steady-state step peak
(``peak_bytes``) is compared with the real CPU run of the same step (``vramledger.measure``; its
``measured_peak_bytes`` is the CPU allocator's own count): error = (estimate - measured) /
measured. Batch 2 x 32 tokens, AdamW. Each (architecture, head)
runs in its own subprocess, with a timeout per run.

Before vramledger sees a config, the head's model built from it takes one plain PyTorch
training step (``plain_step``); a shrink level whose model cannot is replaced by the next
(``SHRINK_LEVELS``), and where none can, vramledger's failure with the same error is put down to
the model or its inputs, not to vramledger. Only what cannot be built from a config at all is
skipped, and counted with the reason.

A per-rank sample: DDP and FSDP estimates (``world_size=2``) of a few architectures against real
2-process gloo runs (``torchrun -m vramledger.cli measure ... --json``, ``ranks_measured``),
every rank compared.

Targets: >= 95 % of the runs estimated without error, >= 90 % within 0.5 % of the real run.
Output: a table, the totals and every failure grouped by cause, written to
benchmarks/results/zoo-<date>-<host>.{json,txt}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# -- the step measured -------------------------------------------------------------------------
BATCH_SIZE = 2
SEQ_LEN = 32
OPTIMIZER = "adamw"
TARGET = "cpu"
PRECISIONS = ("fp32", "bf16-mixed")
DTYPE_VARIANTS = ("none", "bfloat16")
"""``none``: the config.json declares no dtype; ``bfloat16``: it declares ``"dtype": "bfloat16"``."""
WITHIN = 0.005
"""A run is accurate when |error| <= 0.5 %."""
TARGET_ESTIMATED = 0.95
TARGET_WITHIN = 0.90

# -- the sweep ---------------------------------------------------------------------------------
WORKERS = 2
THREADS_PER_WORKER = 1
RUN_TIMEOUT_S = 600
"""Longest a worker may go without reporting (building, or one estimate + measure)."""
SAMPLE_SEED = 0
MAX_PARAMETERS = 60_000_000
"""A shrunk model larger than this is not run (its real run would take too long here)."""
STDERR_TAIL = 2000

# -- shrinking ---------------------------------------------------------------------------------
LAYERS = 2
LAYERS_RETRY = 4
"""Layers of the second try, for models that need two layers of one kind (shared weights)."""
HIDDEN = 64
NUM_HEADS = 4
KV_HEADS = 2
"""Key/value heads of grouped-query configs (1 stays 1; as many as the query heads stays so)."""
HEAD_DIM = HIDDEN // NUM_HEADS
ROPE_HEAD_DIM = 8
INTERMEDIATE = 128
VOCAB = 1024
POSITIONS = 128
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
LORA_RANK = 32
GROUPS = 8
CHUNK = 16
FILTERS = 4
SCALE = 0.25
"""Width and depth multipliers of scaled vision families (EfficientNet, MobileNet)."""
IMAGE_SIZE = 64
PATCH_SIZE = 8
STAGE_WIDTH = 32
"""Width of the first stage of multi-stage vision models (doubling per stage)."""
STAGE_DEPTH = 1
AUDIO_CONV_DIM = 64
AXIAL_ROWS = 4
"""Rows of Reformer's axial position grid (columns: the sequence length over this)."""

# Integer attributes by what they size. First matching rule wins (``_category``).
LAYER_KEYS = frozenset(
    {
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "encoder_layers",
        "decoder_layers",
        "num_encoder_layers",
        "num_decoder_layers",
        "encoder_num_hidden_layers",
        "decoder_num_hidden_layers",
        "num_text_layers",
        "num_vision_layers",
        "depth",
        "encoder_depth",
        "decoder_depth",
        "num_self_attends_per_block",
        "num_mamba_layers",
        "num_attention_layers",
        "max_window_layers",
        "num_blocks",
        "num_layers_per_stack",
    }
)
SUB_LAYER_KEYS = frozenset(
    {
        "first_k_dense_replace",
        "num_dense_layers",
        "first_dense_layers",
        "n_dense_layers",
        "moe_layer_start_index",
        "attn_layer_offset",
        "expert_layer_offset",
    }
)
"""Counts of one kind of layer among the layers: at most ``layers - 1`` (both kinds exist)."""
ZERO_KEYS = frozenset({"num_kv_shared_layers", "num_nextn_predict_layers"})
PERIOD_KEYS = frozenset({"attn_layer_period", "expert_layer_period"})
"""Every how many layers a kind of layer comes (Jamba): at most ``layers``, and its offset
(``*_offset``) at most ``layers - 1``, so each kind is kept."""
LAYER_INDEX_KEY = re.compile(r"(layer_ids|layer_indices|layer_idxs|attn_idxs|_layers)$")
"""Lists of layer indices (which layers are hybrid, attention, dense): kept where those layers
are kept, else the last layer."""
"""Layers that reuse or extend others (KV-sharing tails, multi-token-prediction heads): none."""
KV_HEAD_KEYS = frozenset(
    {
        "num_key_value_heads",
        "n_kv_heads",
        "num_kv_heads",
        "multi_query_group_num",
        "n_head_kv",
        "decoder_num_key_value_heads",
        "encoder_num_key_value_heads",
        "linear_num_key_heads",
        "num_query_groups",
    }
)
HEAD_KEYS = frozenset(
    {
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "num_encoder_attention_heads",
        "num_decoder_attention_heads",
        "attention_heads",
        "num_cross_attention_heads",
        "num_self_attention_heads",
        "index_n_heads",
        "linear_num_value_heads",
    }
)
ROPE_HEAD_DIM_KEYS = frozenset({"qk_rope_head_dim", "rotary_dim", "rotary_emb_dim"})
HEAD_DIM_KEYS = frozenset(
    {
        "head_dim",
        "d_head",
        "d_kv",
        "kv_channels",
        "dim_head",
        "attention_head_size",
        "head_size",
        "query_pre_attn_scalar",
        "qk_nope_head_dim",
        "v_head_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_head_dim",
        "index_head_dim",
        "swa_head_dim",
        "global_head_dim",
        "mamba_d_head",
        "mamba_headdim",
    }
)
FFN_KEY = re.compile(
    r"(intermediate_size|ffn_dim|ffn_hidden_size|d_ff|dim_feedforward|feed_forward_size"
    r"|^n_inner|^hidden_dim|^mlp_dim|^d_inner|^intermediate_dim|_proj_size|codevector_dim"
    r"|^router_hidden_size|xvector_output_dim|^feature_projection_input_dim)$"
)
WIDTH_KEY = re.compile(
    r"^(hidden_size|d_model|n_embd|emb_dim|embed_dim|dim|d_embed|d_latents|word_embed_proj_dim"
    r"|embedding_size|embedding_dim|lru_width|projection_dim|proj_dim|\w+_hidden_size"
    r"|hidden_size_\w+|adapter_in_dim|adapter_out_dim|adapter_input_size)$"
)
POSITION_KEYS = frozenset(
    {
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "max_source_positions",
        "max_target_positions",
        "max_seq_len",
        "max_sequence_length",
        "max_2d_position_embeddings",
        "context_length",
        "max_text_positions",
        "seq_length",
        "original_max_position_embeddings",
    }
)
EXPERT_KEYS = frozenset(
    {
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "moe_num_experts",
        "num_experts_total",
        "n_experts",
        "num_routed_experts",
        "zero_expert_num",
    }
)
TOP_K_KEYS = frozenset(
    {
        "num_experts_per_tok",
        "num_experts_per_token",
        "moe_topk",
        "moe_top_k",
        "num_selected_experts",
        "top_k",
        "n_activated_experts",
        "moe_k",
        "router_topk",
    }
)
ONE_KEYS = frozenset(
    {
        "n_shared_experts",
        "num_shared_experts",
        "n_group",
        "topk_group",
        "num_expert_group",
        "mamba_n_groups",
        "n_groups",
    }
)
"""Shared experts, expert groups and Mamba groups: at most one."""
LORA_RANK_KEYS = frozenset({"q_lora_rank", "kv_lora_rank", "o_lora_rank"})
GROUPS_KEY = re.compile(r"(^num_groups|groups_width|_groups)$")
CHUNK_KEYS = frozenset({"lsh_attn_chunk_length", "local_attn_chunk_length"})
FILTER_KEYS = frozenset({"num_filters"})
"""Channels of the first stage of audio codecs (doubling per stage)."""
SCALE_KEYS = frozenset(
    {"width_coefficient", "depth_coefficient", "width_multiplier", "depth_multiplier"}
)
VOCAB_KEY = re.compile(r"vocab")
TOKEN_ID_KEY = re.compile(r"token_(id|ids|index)$")
NONE_FILLED = {
    "head_dim": HEAD_DIM,
    "num_key_value_heads": None,
    "vocab_size": VOCAB,
    "num_experts_per_tok": EXPERTS_PER_TOKEN,
}
"""Attributes whose default is None but which a real checkpoint's config.json gives (None here:
as many as the query heads)."""

PER_LAYER_KEYS = frozenset(
    {"layer_types", "attn_layers", "layers_block_type", "block_types", "hybrid_override_pattern"}
)
"""Per-layer lists (or pattern strings) that set the layer count where no count is given."""
STAGE_WIDTH_KEYS = frozenset({"hidden_sizes", "embed_dims", "dims", "neck_hidden_sizes", "widths"})
STAGE_DEPTH_KEYS = frozenset({"depths", "blocks_per_stage", "stage_depths", "block_sizes"})
STAGE_HEAD_KEYS = frozenset({"num_heads", "num_attention_heads", "heads"})
AUDIO_CONV_KEYS = frozenset({"conv_dim", "tdnn_dim"})
BACKBONE_KEYS = frozenset({"out_features", "out_indices", "stage_names"})
"""Backbone outputs named after the layers: dropped, so the config recomputes them."""
ROPE_KEYS = frozenset({"rope_parameters", "rope_scaling"})
COMPOSITE_DEFAULTS: dict[str, dict[str, str]] = {
    "encoder-decoder": {"encoder": "bert", "decoder": "bert"},
    "speech-encoder-decoder": {"encoder": "wav2vec2", "decoder": "bert"},
    "vision-encoder-decoder": {"encoder": "vit", "decoder": "gpt2"},
}
"""Composite configs with no defaults of their own: the sub-configs they are built from."""
FORBIDDEN_PACKAGES = {"timm_wrapper": "timm", "timm_backbone": "timm"}
"""Model types that wrap a package this benchmark must not use (timm breaks with this torch)."""
MISSING_ATTRIBUTES = {"pad_token_id": None}
"""Attributes some models read that their config class's defaults lack (a checkpoint's
config.json has them): added when building fails for want of one."""


# -- heads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Head:
    task: str
    """vramledger's task name (a name of our own where vramledger has none)."""
    mapping: str
    """transformers.models.auto.modeling_auto's mapping from model type to class name."""
    auto_class: str
    """The transformers Auto class whose ``from_config`` builds it (as vramledger does)."""
    default: bool = True
    """Swept unless ``--tasks`` names the heads."""


HEADS = (
    Head("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    Head("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    Head("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    Head(
        "image-classification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForImageClassification",
    ),
    Head(
        "sequence-classification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForSequenceClassification",
    ),
    Head(
        "audio-classification",
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForAudioClassification",
    ),
    Head("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    Head("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    Head(
        "token-classification",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForTokenClassification",
        default=False,
    ),
    Head(
        "image-text-to-text",
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "AutoModelForImageTextToText",
        default=False,
    ),
)


def head_of(task: str) -> Head:
    return next(h for h in HEADS if h.task == task)


DISTRIBUTED_SAMPLE = (
    ("llama", "causal-lm"),
    ("gpt2", "causal-lm"),
    ("bert", "masked-lm"),
    ("t5", "seq2seq-lm"),
    ("vit", "image-classification"),
    ("qwen2", "sequence-classification"),
)
DISTRIBUTED_STRATEGIES = ("ddp", "fsdp")
DISTRIBUTED_WORLD = 2


@dataclass(frozen=True, order=True)
class Case:
    arch: str
    """The model type (``config.model_type``)."""
    task: str
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.arch}:{self.task}"


def enumerate_cases(tasks: set[str] | None = None) -> list[Case]:
    """Every (model type, head) pair in transformers' auto mappings, sorted."""
    from transformers.models.auto import modeling_auto

    cases = set()
    for head in HEADS:
        if (head.task not in tasks) if tasks else not head.default:
            continue
        for arch, names in getattr(modeling_auto, head.mapping).items():
            name = names if isinstance(names, str) else names[0]
            cases.add(Case(arch, head.task, name))
    return sorted(cases)


def select_cases(
    cases: list[Case],
    only: set[str] | None = None,
    sample: int | None = None,
    names: list[str] | None = None,
) -> list[Case]:
    if names:
        by_name = {c.name: c for c in cases}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"--cases: no such (architecture:head) case: {unknown}")
        cases = [by_name[n] for n in names]
    if only:
        unknown = only - {c.arch for c in cases}
        if unknown:
            raise SystemExit(f"--only: no such architecture in the mappings: {sorted(unknown)}")
        cases = [c for c in cases if c.arch in only]
    if sample is not None and sample < len(cases):
        cases = sorted(random.Random(SAMPLE_SEED).sample(cases, sample))
    return cases


def supported_tasks() -> tuple[str, ...]:
    """vramledger's task names (``vramledger.tasks.TASKS``; older versions:
    ``vramledger.sources.TASKS``)."""
    try:
        from vramledger.tasks import TASKS
    except ImportError:
        from vramledger.sources import TASKS
    return tuple(TASKS)


# -- shrinking a config ------------------------------------------------------------------------
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

    from vramledger.sources import _hf_skip_init

    with torch.device("meta"), _hf_skip_init():
        model, note = _from_config(case, config)
        model.tie_weights()
    return sum({id(p): p.numel() for p in model.parameters()}.values()), note


PLAIN_TASKS = frozenset(
    {"causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "sequence-classification"}
)
"""Heads whose batch for the plain training step (``plain_step``) this script makes itself;
other heads get vramledger's own default batch (``vramledger.tasks``)."""


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
    batch makes them (``vramledger.tasks.image_input``)."""
    if case.task != "image-classification":
        return False
    import transformers

    try:
        from vramledger.tasks import image_input
    except ImportError:
        return False
    return image_input(config, getattr(transformers, case.class_name, None)) != "pixels"


def _can_feed(task: str) -> bool:
    """Whether ``plain_batch`` can make a batch for the task."""
    if task in PLAIN_TASKS:
        return True
    try:
        from vramledger.tasks import KINDS
    except ImportError:
        return False
    return task in KINDS


def _vramledger_batch(case: Case, config: Any) -> dict[str, Any]:
    import torch
    import transformers

    from vramledger.sources import BatchShape
    from vramledger.tasks import KINDS, model_class

    shape = BatchShape(batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
    cls = model_class(config, case.task) or getattr(transformers, case.class_name)
    return KINDS[case.task].make(config, cls, torch.device("cpu"), shape)


def plain_step(case: Case, config: Any) -> dict[str, Any] | None:
    """One real forward and backward of the head's model built from ``config`` with plain
    transformers and PyTorch (no vramledger), on the batch of ``plain_batch``: None if it
    trains, else the error. Tells a config (or model) that cannot train at all from a failure
    of vramledger's."""
    import torch

    from vramledger.errors import VramledgerError

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


# -- one run -----------------------------------------------------------------------------------
def spec_fields(path: Path, task: str, precision: str) -> dict[str, Any]:
    return dict(
        model=str(path),
        task=task,
        target=TARGET,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        optimizer=OPTIMIZER,
        precision=precision,
    )


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The exception type, vramledger's one line and its message without the hint (operator
    and module parsed out of it), the underlying exception and the innermost frames."""
    from vramledger.errors import VramledgerError

    cause = exc.__cause__ or exc.__context__
    is_ours = isinstance(exc, VramledgerError)
    message = exc.message if is_ours else _exc_line(exc)
    op = re.search(r"operator (\S+)", message)
    module = re.search(r"in module ([^\s:)(]+)", message)
    frames = traceback.extract_tb((cause or exc).__traceback__)
    return {
        "type": type(exc).__name__,
        "vramledger_error": is_ours,
        "one_line": (exc.one_line() if is_ours else message)[:800],
        "message": message[:600],
        "operator": op.group(1) if op else None,
        "module": module.group(1) if module else None,
        "cause_type": type(cause).__name__ if cause is not None else None,
        "cause": _exc_line(cause)[:600] if cause is not None else None,
        "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:]],
        "model_frame": _model_frame(frames),
    }


def _model_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame in transformers' code: where the model did what failed."""
    for f in reversed(frames):
        if f"{os.sep}transformers{os.sep}" in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()}"[:300]
    return None


def _exc_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"


def _param_bytes_per_param(ledger: dict[str, Any]) -> float | None:
    count = ledger.get("parameters") or 0
    held = ledger.get("at_peak", {}).get("parameters", 0)
    return round(held / count, 3) if count else None


def run_one(path: Path, task: str, precision: str) -> dict[str, Any]:
    """Estimate and measure one configuration; never raises."""
    from vramledger import estimate
    from vramledger.measure import measure

    fields = spec_fields(path, task, precision)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        ledger = estimate(**fields)
        est = ledger.to_dict()
        out["estimate_bytes"] = ledger.peak_bytes
        out["estimate_phase"] = est["peak_phase"]
        out["estimate_param_bytes_per_param"] = _param_bytes_per_param(est)
        out["parameters"] = ledger.parameters
    except Exception as exc:
        out["estimate_error"] = describe_error(exc)
    out["estimate_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    try:
        m = measure(device="cpu", **fields)
        real = m.ledger.to_dict()
        out["measured_bytes"] = m.measured_peak_bytes
        out["tracked_bytes"] = m.ledger.peak_bytes
        out["measured_phase"] = real["peak_phase"]
        out["measured_param_bytes_per_param"] = _param_bytes_per_param(real)
    except Exception as exc:
        out["measure_error"] = describe_error(exc)
    out["measure_s"] = round(time.perf_counter() - start, 2)
    has_est, has_real = "estimate_bytes" in out, "measured_bytes" in out
    if has_est and has_real:
        out["error"] = (out["estimate_bytes"] - out["measured_bytes"]) / out["measured_bytes"]
        out["status"] = "ok" if abs(out["error"]) <= WITHIN else "off"
    else:
        out["status"] = {
            (False, True): "estimate failed",
            (True, False): "measure failed",
            (False, False): "both failed",
        }[(has_est, has_real)]
    return out


# -- the worker process ------------------------------------------------------------------------
MARK = "@@zoo "


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def worker(case: Case, runs: list[tuple[str, str]], folder: Path) -> None:
    """Build the case and run ``runs`` ((precision, variant) pairs), one line per result."""
    import torch

    torch.set_num_threads(int(os.environ.get("ZOO_THREADS", THREADS_PER_WORKER)))
    try:
        built = build_case(case)
        paths = write_variants(built.config, folder)
    except BuildSkip as exc:
        _emit({"kind": "build", "status": "skipped", "reason": exc.reason, "detail": exc.detail})
        return
    except Exception as exc:
        _emit({"kind": "build", "status": "skipped", "reason": "build", "detail": _exc_line(exc)})
        return
    supported = case.task in supported_tasks()
    _emit(
        {
            "kind": "build",
            "status": "built",
            "parameters": built.parameters,
            "shrink": built.level,
            "shrink_attempts": built.attempts,
            "plain_step_error": built.plain_step_error,
            "config": str(paths["none"]),
            "supported": supported,
        }
    )
    if not supported:
        return
    for precision, variant in runs:
        result = run_one(paths[variant], case.task, precision)
        _emit({"kind": "run", "precision": precision, "variant": variant, **result})


def distributed_worker(case: Case, strategy: str, folder: Path) -> None:
    """Per-rank estimate and a real torchrun of the same step; one result line."""
    from vramledger import estimate
    from vramledger.measure.local import free_port

    path = write_variants(build_case(case).config, folder)["none"]
    fields = spec_fields(path, case.task, "fp32")
    out: dict[str, Any] = {"kind": "distributed"}
    try:
        ledger = estimate(world_size=DISTRIBUTED_WORLD, strategy=strategy, **fields)
        out["estimate"] = {str(r): led.peak_bytes for ids, led in ledger.ranks for r in ids}
        out["estimate_worst_rank"] = ledger.worst_rank
    except Exception as exc:
        out["estimate_error"] = describe_error(exc)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        str(DISTRIBUTED_WORLD),
        "--master-port",
        str(free_port()),
        "-m",
        "vramledger.cli",
        "measure",
        str(path),
        "--task",
        case.task,
        "--batch-size",
        str(BATCH_SIZE),
        "--seq-len",
        str(SEQ_LEN),
        "--optimizer",
        OPTIMIZER,
        "--precision",
        "fp32",
        "--strategy",
        strategy,
        "--target",
        TARGET,
        "--json",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out["measure_s"] = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        out["measure_error"] = {"type": "torchrun", "message": _last_error_line(done.stderr)}
    else:
        data = json.loads(done.stdout)
        out["measured"] = {str(r["rank"]): r["measured_peak_bytes"] for r in data["ranks_measured"]}
        out["tracked"] = {str(r["rank"]): r["tracked_peak_bytes"] for r in data["ranks_measured"]}
    _emit(out)


def _last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(\w+(Error|Exception)|error:)", ln.strip())]
    return (errors[-1] if errors else lines[-1] if lines else "no output").strip()[:600]


# -- the parent: subprocesses with a timeout per run -------------------------------------------
@dataclass
class Options:
    precisions: tuple[str, ...] = PRECISIONS
    variants: tuple[str, ...] = DTYPE_VARIANTS
    timeout_s: float = RUN_TIMEOUT_S
    threads: int = THREADS_PER_WORKER


def _spawn(args: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "ZOO_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _lines(proc: subprocess.Popen, timeout_s: float) -> Iterator[dict[str, Any] | None]:
    """The worker's result lines; ``None`` once it has been silent for ``timeout_s`` (it is then
    killed)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                lines.put(line[len(MARK) :])
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            _kill(proc)
            yield None
            return
        if line is None:
            return
        yield json.loads(line)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Worker:
    """A worker subprocess: its result lines, each awaited at most ``timeout_s`` (then it is
    killed, with everything it started), and the last line of its stderr."""

    def __init__(self, args: list[str], threads: int) -> None:
        self.proc = _spawn(args, threads)
        self.timed_out = False
        self._stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self._stderr.append(self.proc.stderr.read())

    def results(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        for line in _lines(self.proc, timeout_s):
            if line is None:
                self.timed_out = True
                return
            yield line

    def finish(self) -> str:
        """Wait for the worker; why it stopped, if it did not end cleanly."""
        code = self.proc.wait()
        self._reader.join()
        if self.timed_out:
            return "no result within the timeout"
        return f"exit code {code}: {_last_error_line(''.join(self._stderr))}"


def _case_record(base: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
    return {**base, "precision": "-", "variant": "-", "status": status, **fields}


def run_case(case: Case, options: Options) -> list[dict[str, Any]]:
    """Every run of a case, in subprocesses: a worker that hangs or dies is replaced by a new
    one for the runs left after the one it was on."""
    base = {"arch": case.arch, "task": case.task, "class": case.class_name}
    pending = [(p, v) for p in options.precisions for v in options.variants]
    records: list[dict[str, Any]] = []
    build: dict[str, Any] | None = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{case.arch}-") as tmp:
        while pending:
            args = ["--_worker", case.arch, case.task, case.class_name, tmp]
            worker_ = Worker(args + [f"{p}/{v}" for p, v in pending], options.threads)
            finished: set[tuple[str, str]] = set()
            for line in worker_.results(options.timeout_s):
                if line["kind"] == "build":
                    build = line
                else:
                    finished.add((line["precision"], line["variant"]))
                    records.append({**base, **{k: v for k, v in line.items() if k != "kind"}})
            why = worker_.finish()
            status = "timeout" if worker_.timed_out else "crashed"
            if build is None:
                return [_case_record(base, "skipped", reason=status, detail=f"building: {why}")]
            if build["status"] == "skipped":
                return [
                    _case_record(base, "skipped", reason=build["reason"], detail=build["detail"])
                ]
            if not build["supported"]:
                detail = (
                    f"vramledger.sources.TASKS has no {case.task!r} "
                    f"(it has {', '.join(supported_tasks())})"
                )
                return [
                    _case_record(
                        base,
                        "unsupported task",
                        detail=detail,
                        model_parameters=build["parameters"],
                        shrink=build["shrink"],
                    )
                ]
            pending = [r for r in pending if r not in finished]
            if pending:  # the worker stopped on pending[0]: say why, go on with the rest
                (precision, variant), pending = pending[0], pending[1:]
                records.append(
                    {
                        **base,
                        "precision": precision,
                        "variant": variant,
                        "status": status,
                        "detail": why,
                    }
                )
    assert build is not None
    for r in records:
        r.update(
            shrink=build["shrink"],
            shrink_attempts=build["shrink_attempts"],
            plain_step_error=build["plain_step_error"],
            model_parameters=build["parameters"],
            case_s=round(time.perf_counter() - start, 1),
        )
    return sorted(records, key=lambda r: (r["precision"], r["variant"]))


def run_distributed(case: Case, strategy: str, options: Options) -> dict[str, Any]:
    """The per-rank estimate against a real 2-process gloo run (in a worker subprocess)."""
    base = {"arch": case.arch, "task": case.task, "strategy": strategy}
    with tempfile.TemporaryDirectory(prefix=f"zoo-dist-{case.arch}-") as tmp:
        args = ["--_distributed", case.arch, case.task, case.class_name, strategy, tmp]
        worker_ = Worker(args, options.threads)
        result = next(iter(worker_.results(2 * options.timeout_s)), None)
        why = worker_.finish()
    if result is None:
        return {**base, "status": "timeout" if worker_.timed_out else "crashed", "detail": why}
    return judge_distributed({**base, **{k: v for k, v in result.items() if k != "kind"}})


def judge_distributed(out: dict[str, Any]) -> dict[str, Any]:
    """Each rank's estimate against its real peak. The tracker's count of the real run decides
    (as tests/test_distributed_real.py compares: torch.profiler's memory events miss frees made
    on gloo's worker threads, so the allocator's count drifts high with timing); the error
    against the allocator's count is kept beside it."""
    if "estimate" in out and "measured" in out:
        per_rank = {}
        for rank, measured in out["measured"].items():
            est, tracked = out["estimate"].get(rank), out["tracked"][rank]
            per_rank[rank] = {
                "estimate": est,
                "measured": measured,
                "tracked": tracked,
                "error": (est - measured) / measured if est is not None else None,
                "error_vs_tracked": (est - tracked) / tracked if est is not None else None,
            }
        out["per_rank"] = per_rank
        known = [r for r in per_rank.values() if r["estimate"] is not None]
        out["worst_error_vs_tracked"] = max(
            (abs(r["error_vs_tracked"]) for r in known), default=None
        )
        out["worst_error"] = max((abs(r["error"]) for r in known), default=None)
        worst = out["worst_error_vs_tracked"]
        out["status"] = "ok" if worst is not None and worst <= WITHIN else "off"
    else:
        failed = ("estimate_error" in out, "measure_error" in out)
        out["status"] = {
            (True, False): "estimate failed",
            (False, True): "measure failed",
        }.get(failed, "both failed")
    return out


def sweep(
    cases: list[Case], options: Options, workers: int, progress: bool = True
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = [0]

    def one(case: Case) -> None:
        result = run_case(case, options)
        with lock:
            records.extend(result)
            done[0] += 1
            if progress:
                statuses = Counter(r["status"] for r in result)
                print(
                    f"[{done[0]}/{len(cases)}] {case.name}: "
                    + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())),
                    flush=True,
                )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, cases))
    records.sort(key=lambda r: (r["arch"], r["task"], r["precision"], r["variant"]))
    return records


# -- totals, triage, table ---------------------------------------------------------------------
RUN_STATUSES = (
    "ok",
    "off",
    "estimate failed",
    "measure failed",
    "both failed",
    "timeout",
    "crashed",
)


def totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    cases = {(r["arch"], r["task"]) for r in records}
    skipped = {(r["arch"], r["task"]) for r in records if r["status"] == "skipped"}
    unsupported = {(r["arch"], r["task"]) for r in records if r["status"] == "unsupported task"}
    runs = [r for r in records if r["status"] in RUN_STATUSES]
    estimated = [r for r in runs if "estimate_bytes" in r]
    compared = [r for r in runs if "error" in r]
    within = [r for r in compared if abs(r["error"]) <= WITHIN]
    archs = {r["arch"] for r in records}
    archs_built = {r["arch"] for r in records if r["status"] != "skipped"}
    return {
        "architectures": len(archs),
        "architectures_built": len(archs_built),
        "cases": len(cases),
        "cases_built": len(cases) - len(skipped),
        "cases_skipped": len(skipped),
        "skip_reasons": dict(
            Counter(r["reason"] for r in records if r["status"] == "skipped").most_common()
        ),
        "cases_unsupported_task": len(unsupported),
        "unsupported_tasks": dict(
            Counter(r["task"] for r in records if r["status"] == "unsupported task").most_common()
        ),
        "runs": len(runs),
        "runs_by_status": dict(Counter(r["status"] for r in runs).most_common()),
        "estimated": len(estimated),
        "estimated_share": _share(len(estimated), len(runs)),
        "measured": sum("measured_bytes" in r for r in runs),
        "compared": len(compared),
        "within": len(within),
        "within_share_of_compared": _share(len(within), len(compared)),
        "within_share_of_runs": _share(len(within), len(runs)),
        "target_estimated": TARGET_ESTIMATED,
        "target_within": TARGET_WITHIN,
        "within_tolerance": WITHIN,
    }


def _share(n: int, d: int) -> float | None:
    return n / d if d else None


def failure_cause(r: dict[str, Any]) -> str:
    """A grouping key for a failed run: what went wrong, without the parts that name one model
    (module paths, quoted names, numbers)."""
    if r["status"] == "skipped":
        return f"skipped: {r['reason']}"
    if r["status"] in ("timeout", "crashed"):
        return f"{r['status']}: {_normalise(r.get('detail', ''))}"
    if r["status"] == "off":
        return f"estimate off by > {100 * WITHIN:.1f} %"
    est, real = r.get("estimate_error"), r.get("measure_error")
    plain = r.get("plain_step_error")
    if plain and plain["type"] == "InputError":  # vramledger's own batch maker, not the model
        plain = None
    same = plain and any(_same_error(plain, e) for e in (est, real) if e)
    if same:
        return (
            "the model does not train on these inputs with any shrunk config (a plain PyTorch "
            f"step fails too): {_normalise(plain['message'])}"
        )
    who = "estimate and real run" if est and real else "estimate" if est else "real run only"
    err = est or real
    frame = err.get("model_frame")
    at = f" (at {frame.split(':')[0]} {frame.split(' ')[1].rstrip(':')})" if frame else ""
    if err.get("operator"):  # where the model called it: the group's ``sites``
        why = re.sub(r".*?operator \S+ (.*?) \(in module.*", r"\1", err["message"])
        return f"{who}: {err['type']}: operator {err['operator']} {why}"
    if err.get("vramledger_error"):
        return f"{who}: {err['type']}: {_normalise(err['message'])}"
    return f"{who}: {_normalise(err['message'])}{at}"  # the message names the type


def _same_error(plain: dict[str, Any], err: dict[str, Any]) -> bool:
    """Whether vramledger failed the way the plain step did (the same exception text)."""
    text = plain["message"].split(": ", 1)[-1][:80]
    return bool(text) and text in err.get("message", "")


def _normalise(text: str) -> str:
    text = text.strip().splitlines()[0] if text.strip() else ""
    text = re.sub(r"/\S+", "PATH", text)
    text = re.sub(r"in module [^\s:)]+", "in module M", text)
    text = re.sub(r"\bthe [\w.-]+ config\b", "the … config", text)
    text = re.sub(r"\bcalling \w+ with\b", "calling … with", text)
    text = re.sub(r"'\w*(Config|Model|For\w+|Layer|Attention|Block|MLP)\w*'", "'…'", text)
    text = re.sub(r"\b\d+(\.\d+)?\b", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return text[:160]


def _sites(errors: list[dict[str, Any]]) -> list[str]:
    """The distinct lines of model code the errors were raised from (the same line copied into
    several models once, with the first file that has it), most common first."""
    lines: dict[str, list[str]] = {}
    for e in errors:
        frame = e.get("model_frame")
        if frame:
            where, _, code = frame.partition(": ")
            lines.setdefault(code, []).append(where)
    ranked = sorted(lines.items(), key=lambda kv: -len(kv[1]))
    return [f"{code} ({wheres[0]}; {len(wheres)} runs)" for code, wheres in ranked]


def triage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures grouped by cause, most common first: the cases, the modules named, one example
    line, and the errors of runs that were compared."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["status"] not in ("ok", "unsupported task"):
            groups[failure_cause(r)].append(r)
    out = []
    for cause, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        errors = [r.get("estimate_error") or r.get("measure_error") or {} for r in rs]
        first, first_error = rs[0], errors[0]
        line = first_error.get("one_line") or first.get("detail", "")
        if first_error.get("model_frame"):
            line = f"{line} [model code: {first_error['model_frame']}]"
        elif first_error and not first_error.get("vramledger_error") and first_error.get("where"):
            line = f"{line} (at {first_error['where'][-1]})"
        if cause.startswith("the model does not train"):
            line = f"plain step: {first['plain_step_error']['message']} | vramledger: {line}"
        out.append(
            {
                "cause": cause,
                "runs": len(rs),
                "cases": sorted({f"{r['arch']}:{r['task']}" for r in rs}),
                "modules": sorted({e["module"] for e in errors if e.get("module")}),
                "sites": _sites(errors),
                "example": f"{first['arch']}:{first['task']} {first['precision']}/"
                f"{first['variant']}: {line}"
                if line
                else "",
                "errors": {
                    f"{r['arch']}:{r['task']} {r['precision']}/{r['variant']}": r["error"]
                    for r in rs
                    if "error" in r
                },
            }
        )
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def table(records: list[dict[str, Any]]) -> str:
    cols = ("architecture", "task", "precision", "dtype", "status", "estimate", "measured", "error")
    rows = []
    for r in records:
        err = r.get("error")
        rows.append(
            (
                r["arch"],
                r["task"],
                r["precision"],
                r["variant"],
                r["status"],
                _mib(r.get("estimate_bytes")),
                _mib(r.get("measured_bytes")),
                "-" if err is None else f"{100 * err:+.4f} %",
            )
        )
    widths = [
        max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    right = {5, 6, 7}

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(cols), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def distributed_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "per-rank sample (fp32 AdamW, world size 2, gloo): each rank's estimate against the "
        "tracker's count of its real run (the status), and against its allocator count "
        "(profiler events, which miss frees on gloo's threads)"
    ]
    for r in results:
        head = f"  {r['arch']}:{r['task']} {r['strategy']}: {r['status']}"
        if "per_rank" in r:
            ranks = "; ".join(
                f"rank {k} est {_mib(v['estimate'])} tracked {_mib(v['tracked'])} "
                f"({100 * v['error_vs_tracked']:+.3f} %), allocator {_mib(v['measured'])} "
                f"({100 * v['error']:+.3f} %)"
                for k, v in sorted(r["per_rank"].items())
            )
            head += f" — {ranks}"
        else:
            err = r.get("estimate_error") or r.get("measure_error") or {}
            head += f" — {err.get('message') or r.get('detail', '')}"
        lines.append(head)
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    t = result["totals"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    lines = [
        f"architectures: {t['architectures']} ({t['architectures_built']} built); "
        f"(architecture, head) cases: {t['cases']}, built {t['cases_built']}, "
        f"skipped {t['cases_skipped']} {t['skip_reasons']}",
        f"unsupported task (built, not run): {t['cases_unsupported_task']} {t['unsupported_tasks']}",
        f"runs (case x precision x dtype variant): {t['runs']} {t['runs_by_status']}",
        f"estimated without error: {t['estimated']}/{t['runs']} = {pct(t['estimated_share'])} "
        f"(target {100 * TARGET_ESTIMATED:.0f} %)",
        f"within {100 * WITHIN:.1f} % of the real run: {t['within']}/{t['compared']} compared = "
        f"{pct(t['within_share_of_compared'])}; of all runs {t['within']}/{t['runs']} = "
        f"{pct(t['within_share_of_runs'])} (target {100 * TARGET_WITHIN:.0f} %)",
        f"took {result['seconds'] / 60:.1f} min with {result['workers']} workers",
        "",
        "failures by cause (most common first):",
    ]
    for g in result["triage"]:
        lines.append(f"  [{g['runs']} runs, {len(g['cases'])} cases] {g['cause']}")
        lines.append(f"      cases: {', '.join(g['cases'])}")
        if g["modules"]:
            lines.append(f"      modules: {', '.join(g['modules'][:12])}")
        for site in g.get("sites", [])[:6]:
            lines.append(f"      at: {site}")
        if g["example"]:
            lines.append(f"      e.g. {_one_line(g['example'])}")
        if g["errors"]:
            shown = sorted(g["errors"].items(), key=lambda kv: -abs(kv[1]))[:20]
            lines.append("      " + ", ".join(f"{k} {100 * v:+.3f} %" for k, v in shown))
    return "\n".join(lines)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ⏎ ".join(ln.strip() for ln in text.strip().splitlines())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import vramledger

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    package = Path(vramledger.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vramledger": vramledger.__version__,
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty_files": git("status", "--porcelain", "--", "src").splitlines(),
        "vramledger_path": str(package),
        "vramledger_sources_sha256": digest.hexdigest(),
        "cpus": os.cpu_count(),
    }


# -- command line ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers", type=int, default=WORKERS, help=f"parallel cases (default {WORKERS})"
    )
    p.add_argument("--only", help="architectures (model types), comma-separated")
    p.add_argument(
        "--tasks",
        help="heads, comma-separated (default: all but those marked *): "
        + ", ".join(h.task + ("" if h.default else "*") for h in HEADS),
    )
    p.add_argument("--sample", type=int, help="a deterministic sample of N cases")
    p.add_argument(
        "--cases", help="these cases only, comma-separated ARCH:HEAD (e.g. llama:causal-lm)"
    )
    p.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated vramledger precisions (default {','.join(PRECISIONS)})",
    )
    p.add_argument(
        "--dtype-variants",
        default=",".join(DTYPE_VARIANTS),
        help="config.json declares no dtype (none) and/or this dtype (default none,bfloat16)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=RUN_TIMEOUT_S,
        help=f"seconds per run (default {RUN_TIMEOUT_S})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=THREADS_PER_WORKER,
        help=f"torch threads per worker (default {THREADS_PER_WORKER})",
    )
    p.add_argument("--no-distributed", action="store_true", help="skip the per-rank sample")
    p.add_argument("--distributed-only", action="store_true", help="only the per-rank sample")
    p.add_argument(
        "--out", type=Path, help="JSON output (default benchmarks/results/zoo-DATE-HOST.json)"
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--retriage",
        type=Path,
        metavar="ZOO.json",
        help="recompute the totals, triage and text of an earlier result (no runs)",
    )
    return p.parse_args(argv)


def _csv(text: str | None) -> list[str]:
    """Comma-separated names, in order."""
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        arch, task, cls, folder, *runs = argv[1:]
        worker(Case(arch, task, cls), [tuple(r.split("/")) for r in runs], Path(folder))
        return 0
    if argv[:1] == ["--_distributed"]:
        arch, task, cls, strategy, folder = argv[1:]
        distributed_worker(Case(arch, task, cls), strategy, Path(folder))
        return 0
    args = parse_args(argv)
    if args.retriage:
        return retriage(args.retriage, args.out)
    from vramledger.precision import PRECISIONS as KNOWN_PRECISIONS

    tasks = set(_csv(args.tasks)) | {n.split(":", 1)[-1] for n in _csv(args.cases)}
    for option, given, known in (
        ("--tasks", tasks, {h.task for h in HEADS}),
        ("--precisions", set(_csv(args.precisions)), set(KNOWN_PRECISIONS)),
        ("--dtype-variants", set(_csv(args.dtype_variants)), set(DTYPE_VARIANTS)),
    ):
        if given - known:
            raise SystemExit(f"{option}: unknown {sorted(given - known)}; use {sorted(known)}")
    cases = select_cases(
        enumerate_cases(tasks), set(_csv(args.only)), args.sample, _csv(args.cases)
    )
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    options = Options(
        precisions=tuple(_csv(args.precisions)),
        variants=tuple(_csv(args.dtype_variants)),
        timeout_s=args.timeout,
        threads=args.threads,
    )
    start = time.perf_counter()
    records = [] if args.distributed_only else sweep(cases, options, args.workers)
    dist_results = []
    if not args.no_distributed:
        chosen = args.only or args.tasks or args.cases or args.sample is not None
        wanted = {c.name for c in cases} if chosen else None
        dist_cases = [
            c
            for c in enumerate_cases()
            if (c.arch, c.task) in DISTRIBUTED_SAMPLE and (wanted is None or c.name in wanted)
        ]
        for c in dist_cases:
            for strategy in DISTRIBUTED_STRATEGIES:
                r = run_distributed(c, strategy, options)
                print(f"per-rank {c.name} {strategy}: {r['status']}", flush=True)
                dist_results.append(r)
    result = {
        "benchmark": "zoo",
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "environment": environment(),
        "step": {
            "batch_size": BATCH_SIZE,
            "seq_len": SEQ_LEN,
            "optimizer": OPTIMIZER,
            "target": TARGET,
            "precisions": list(options.precisions),
            "dtype_variants": list(options.variants),
            "compared": "estimate.peak_bytes vs measure(...).measured_peak_bytes "
            "(CPU allocator's count, torch.profiler memory events)",
        },
        "shrink": {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "heads": NUM_HEADS,
            "kv_heads": KV_HEADS,
            "intermediate": INTERMEDIATE,
            "vocab": VOCAB,
            "positions": POSITIONS,
            "experts": EXPERTS,
            "experts_per_token": EXPERTS_PER_TOKEN,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "max_parameters": MAX_PARAMETERS,
        },
        "workers": args.workers,
        "threads_per_worker": options.threads,
        "seconds": time.perf_counter() - start,
        "records": records,
        "distributed": dist_results,
    }
    out = args.out or RESULTS / f"zoo-{datetime.date.today()}-{platform.node() or 'host'}.json"
    report(result, out)
    return 0


def report(result: dict[str, Any], out: Path) -> None:
    """Totals and triage from the records; print the table, totals and failures; write the
    JSON and the text beside it."""
    records, dist_results = result["records"], result["distributed"]
    result["totals"] = totals(records)
    result["triage"] = triage(records)
    text = "\n\n".join(
        ([table(records), summary(result)] if records else [])
        + ([distributed_table(dist_results)] if dist_results else [])
    )
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".txt").write_text(text + "\n")
    print(f"\nwritten: {out} and {out.with_suffix('.txt').name}")


def retriage(path: Path, out: Path | None) -> int:
    result = json.loads(path.read_text())
    result["distributed"] = [judge_distributed(r) for r in result.get("distributed", [])]
    report(result, out or path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
