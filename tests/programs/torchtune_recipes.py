"""torchtune's own recipes and configs, as the wheel ships them, on a tiny Llama-3.2-shaped
checkpoint made here (tests/test_run_torchtune_recipes.py, benchmarks/programs.py):

    python tests/programs/torchtune_recipes.py DIR

makes ``DIR/checkpoint``: ``model.safetensors`` (random weights of a 2-layer model built by
torchtune's own ``llama3_2`` builder, in Hugging Face's names, with its ``config.json``) and
``tokenizer.model`` (a tiktoken BPE file of the 256 bytes and a few merges; torchtune's
``llama3_tokenizer`` adds Llama 3's special tokens at 128,000 and up, so the model keeps Llama
3's vocabulary of 128,256), and ``DIR/data.json`` (Alpaca-style samples). Nothing is downloaded.
Each recipe runs with a config of torchtune's (``llama3_2/1B_lora_single_device``, ...) as
shipped, made tiny and pointed at these files by command-line overrides, as a user overrides a
config (:func:`command`):

    tune run lora_finetune_single_device --config llama3_2/1B_lora_single_device OVERRIDES...
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from torchtune_tiny import hf_config, save_hf

WORDS = [f"w{i}" for i in range(40)]
SAMPLES = 16
WORDS_PER_FIELD = 6
VOCAB = 128_256
"""Llama 3's vocabulary: the tokenizer's special tokens are ids 128,000-128,255."""
MODEL = {
    "vocab_size": VOCAB,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "embed_dim": 128,
    "max_seq_len": 256,
    "intermediate_dim": 256,
}
"""Llama-3.2-shaped (scaled RoPE, tied embedding, grouped-query attention). Every projection
has a multiple of 16,384 elements: torchao's NF4 (QLoRA) quantizes in blocks of 64 values and
their scales again in blocks of 256."""
PROMPT_WORDS = [
    "Below",
    " is",
    " an",
    " instruction",
    " that",
    " describes",
    " a",
    " task",
    "###",
    " Instruction",
    " Response",
]

RECIPES = {
    "lora": ("lora_finetune_single_device", "llama3_2/1B_lora_single_device", "lora_llama3_2"),
    "qlora": ("lora_finetune_single_device", "llama3_2/1B_qlora_single_device", "lora_llama3_2"),
    "full": ("full_finetune_single_device", "llama3_2/1B_full_single_device", "llama3_2"),
}
"""Name -> (recipe, torchtune's config, the builder of the config's model at any size)."""


def command(name: str, *extra: str, steps: int = 4) -> tuple[str, ...]:
    """``tune``'s arguments for recipe ``name`` with its shipped config, overridden to the tiny
    model and local files (run in the folder :func:`make` filled)."""
    recipe, config, builder = RECIPES[name]
    model = [f"model._component_=torchtune.models.llama3_2.{builder}"]
    model += [f"model.{k}={v}" for k, v in MODEL.items()]
    if name == "qlora":
        model.append("model.quantize_base=True")
    return (
        "run",
        recipe,
        "--config",
        config,
        *model,
        "checkpointer.checkpoint_dir=checkpoint",
        "tokenizer.path=checkpoint/tokenizer.model",
        "dataset._component_=torchtune.datasets.alpaca_dataset",
        "dataset.source=json",
        "dataset.data_files=data.json",
        "dataset.split=train",
        "output_dir=out",
        "batch_size=2",
        f"max_steps_per_epoch={steps}",
        "gradient_accumulation_steps=1",
        "seed=0",
        "shuffle=False",
        *extra,
    )


def _tokenizer(path: Path) -> None:
    ranks = [bytes([i]) for i in range(256)]
    for word in PROMPT_WORDS + [" " + w for w in WORDS]:
        encoded = word.encode()
        for end in range(2, len(encoded) + 1):
            if encoded[:end] not in ranks:
                ranks.append(encoded[:end])
    path.write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for i, b in enumerate(ranks)))


def _weights(checkpoint: Path) -> None:
    import torch
    from torchtune.models.llama3_2 import llama3_2

    torch.manual_seed(0)
    state = llama3_2(**MODEL).state_dict()
    # tied to the embedding, as Llama 3.2 1B saves it
    save_hf(state, MODEL, checkpoint / "model.safetensors", tied=True)
    config = {**hf_config(MODEL), "vocab_size": VOCAB, "tie_word_embeddings": True}
    (checkpoint / "config.json").write_text(json.dumps(config))


def make(root: Path) -> Path:
    """``root/checkpoint`` and ``root/data.json``, made (seeded: the same files every time)."""
    checkpoint = root / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    _tokenizer(checkpoint / "tokenizer.model")
    _weights(checkpoint)
    samples = [
        {
            "instruction": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
            "input": "",
            "output": " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
        }
        for i in range(SAMPLES)
    ]
    (root / "data.json").write_text(json.dumps(samples))
    return checkpoint


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {sys.argv[0]} DIR")
    print(make(Path(sys.argv[1])))
