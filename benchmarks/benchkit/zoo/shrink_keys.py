"""Which config keys the generic shrink sets, by what they mean (layers, widths, heads, experts, ...)."""

from __future__ import annotations

import re

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
