"""A tiny Llama (random weights), its word-level tokenizer and a local text dataset, saved as
TRL's own scripts read them (``trl sft --model_name_or_path model --dataset_name data``):
``model/`` by ``save_pretrained`` (config, safetensors, tokenizer with a chat template) and
``data/train.jsonl``, which ``datasets.load_dataset("data")`` reads. Nothing is downloaded."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(500)]
ROWS = 32
WORDS_PER_ROW = 48


def make(root: Path) -> Path:
    """``root/model`` and ``root/data``, made (seeded: the same files every time)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    rng = random.Random(0)
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"text": " ".join(rng.choices(WORDS, k=WORDS_PER_ROW))} for _ in range(ROWS)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


if __name__ == "__main__":
    make(Path(sys.argv[1]))
