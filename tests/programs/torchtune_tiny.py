"""A tiny torchtune checkpoint, tokenizer, data and recipe config, made in a folder, for
`tune run lora_finetune_single_device` under `vramledger run` (tests/test_run_torchtune.py,
benchmarks/programs.py):

    python tests/programs/torchtune_tiny.py DIR [hf|meta]

makes ``DIR/checkpoint`` (random weights of a 2-layer Llama-2-shaped model built by torchtune's
own ``llama2`` builder, saved as the format's checkpointer reads it: ``hf``, the default,
``model.safetensors`` in Hugging Face's names with its ``config.json``, read by
``FullModelHFCheckpointer``; ``meta``, ``consolidated.00.pth`` (``torch.save``) in Meta's names,
read by ``FullModelMetaCheckpointer``; and a SentencePiece ``tokenizer.model`` trained here on
the samples' words), ``DIR/data.json`` (Alpaca-style samples, all of one length so that every
batch has the same shape) and ``DIR/config.yaml`` (torchtune's ``llama2/7B_lora_single_device``
settings, the model made tiny, on local files). Nothing is downloaded. Run it there with

    tune run lora_finetune_single_device --config config.yaml
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(40)]
SAMPLES = 8
WORDS_PER_FIELD = 6
VOCAB = 128
"""SentencePiece pieces; the model's vocabulary."""
MODEL = {
    "vocab_size": VOCAB,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "max_seq_len": 128,
    "intermediate_dim": 160,
}
"""A Llama-2-shaped model (RMSNorm, SwiGLU MLP, grouped-query attention, rotary embeddings) of
about 0.1 M parameters."""
CHECKPOINTS = {
    "hf": ("torchtune.training.FullModelHFCheckpointer", "model.safetensors"),
    "meta": ("torchtune.training.FullModelMetaCheckpointer", "consolidated.00.pth"),
}
"""Each format's checkpointer and the file it reads."""

CONFIG = """\
# torchtune's llama2/7B_lora_single_device settings on a tiny model and local files
output_dir: out
model:
  _component_: torchtune.models.llama2.lora_llama2
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  apply_lora_to_output: False
  {model}
  lora_rank: 8
  lora_alpha: 16
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama2.llama2_tokenizer
  path: checkpoint/tokenizer.model
  max_seq_len: null
checkpointer:
  _component_: {checkpointer}
  checkpoint_dir: checkpoint
  checkpoint_files: [{file}]
  adapter_checkpoint: null
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA2
resume_from_checkpoint: False
save_adapter_weights_only: False
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  source: json
  data_files: data.json
  split: train
  packed: False
seed: 0
shuffle: False
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 1
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
epochs: 1
max_steps_per_epoch: null
gradient_accumulation_steps: 1
clip_grad_norm: null
compile: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
log_peak_memory_stats: True
device: cuda
dtype: bf16
enable_activation_checkpointing: False
enable_activation_offloading: False
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
"""


def _tokenizer(path: Path, sentences: list[str]) -> None:
    """A SentencePiece BPE model of ``VOCAB`` pieces trained on ``sentences`` (with the Alpaca
    prompt's words), as Llama 2's tokenizer.model is one."""
    import sentencepiece as spm

    prompt = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request. ### Instruction: ### Response:"
    )
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([prompt, *sentences] * 4),
        model_writer=model,
        vocab_size=VOCAB,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())


def _weights(checkpoint: Path, fmt: str) -> None:
    import torch
    from torchtune.models import convert_weights
    from torchtune.models.llama2 import llama2

    torch.manual_seed(0)
    state = llama2(**MODEL).state_dict()
    if fmt == "meta":
        torch.save(convert_weights.tune_to_meta(state), checkpoint / CHECKPOINTS[fmt][1])
        (checkpoint / "params.json").write_text(json.dumps(MODEL))
        return
    save_hf(state, MODEL, checkpoint / CHECKPOINTS[fmt][1])
    config = {**hf_config(MODEL), "vocab_size": VOCAB, "torch_dtype": "float32"}
    config["max_position_embeddings"] = MODEL["max_seq_len"]
    (checkpoint / "config.json").write_text(json.dumps(config))


def save_hf(state: dict, model: dict, file: Path, tied: bool = False) -> None:
    """torchtune's ``state`` of a model built with ``model``'s arguments, in Hugging Face's
    names, as safetensors (``tied``: without the output weight, which is the embedding's)."""
    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    heads, kv_heads, dim = model["num_heads"], model["num_kv_heads"], model["embed_dim"]
    hf = convert_weights.tune_to_hf(state, num_heads=heads, num_kv_heads=kv_heads, dim=dim)
    if tied:
        hf.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in hf.items()}, file)


def hf_config(model: dict) -> dict:
    """The Llama ``config.json`` fields of a model built with ``model``'s arguments."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["embed_dim"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "num_hidden_layers": model["num_layers"],
        "intermediate_size": model["intermediate_dim"],
    }


def make(root: Path, fmt: str = "hf") -> tuple[Path, Path, Path]:
    """``root/checkpoint``, ``root/data.json`` and ``root/config.yaml``, made (seeded: the same
    files every time)."""
    checkpointer, file = CHECKPOINTS[fmt]
    checkpoint = root / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    samples = [
        {
            "instruction": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
            "input": "",
            "output": " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
        }
        for i in range(SAMPLES)
    ]
    _tokenizer(
        checkpoint / "tokenizer.model", [s[f] for s in samples for f in ("instruction", "output")]
    )
    _weights(checkpoint, fmt)
    data = root / "data.json"
    data.write_text(json.dumps(samples))
    model = "\n  ".join(f"{k}: {v}" for k, v in MODEL.items())
    config = root / "config.yaml"
    config.write_text(CONFIG.format(model=model, checkpointer=checkpointer, file=file))
    return checkpoint, data, config


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(f"usage: python {sys.argv[0]} DIR [hf|meta]")
    for made in make(Path(sys.argv[1]), *sys.argv[2:]):
        print(made)
