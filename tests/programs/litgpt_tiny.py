"""A tiny LitGPT checkpoint and local data, made in a folder, for `litgpt finetune` and `litgpt
pretrain` under `vramledger run` (tests/test_run_litgpt.py, benchmarks/programs.py):

    python tests/programs/litgpt_tiny.py DIR

makes ``DIR/checkpoint`` (``model_config.yaml`` of a 2-layer Llama-shaped model, a
``lit_model.pth`` of random weights, a word-level ``tokenizer.json`` built with the
``tokenizers`` library and its ``tokenizer_config.json``) and ``DIR/data.json`` (instruction
samples for LitGPT's ``JSON`` data module, all of one length so that every batch has the same
shape). Nothing is downloaded.

:class:`TinyTokens` is a data module for ``litgpt pretrain`` (``--data
litgpt_tiny.TinyTokens``, this folder on ``PYTHONPATH``): fixed random token blocks, made in
memory, as LitGPT's own litdata-backed modules (TinyStories, TextFiles) would give them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(40)]
"""The samples' words: the tokenizer's vocabulary, with the words of LitGPT's Alpaca prompt."""
SPECIAL = ["<unk>", "<s>", "</s>"]
SAMPLES = 8
WORDS_PER_FIELD = 6
MODEL = {
    "name": "tiny-llama",
    "hf_config": {},
    "block_size": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_query_groups": 2,
    "n_embd": 64,
    "intermediate_size": 160,
    "vocab_size": 64,
    "padded_vocab_size": 64,
    "bias": False,
    "rotary_percentage": 1.0,
    "parallel_residual": False,
    "norm_class_name": "RMSNorm",
    "norm_eps": 1e-5,
    "mlp_class_name": "LLaMAMLP",
}
"""A Llama-shaped model (RMSNorm, SwiGLU MLP, grouped-query attention, rotary embeddings) of
about 0.1 M parameters; 64 token ids cover the tokenizer's."""


def _tokenizer(folder: Path) -> None:
    from litgpt.prompts import PromptStyle
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    prompt = PromptStyle.from_name("alpaca").apply("")
    prompt_words = [w for w, _ in Whitespace().pre_tokenize_str(prompt)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIAL, *WORDS, *prompt_words]))}
    assert len(vocab) <= MODEL["padded_vocab_size"]
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make(root: Path) -> tuple[Path, Path]:
    """``root/checkpoint`` and ``root/data.json``, made (seeded: the same files every time)."""
    import torch
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    checkpoint = root / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    config = Config(**MODEL)
    save_config(config, checkpoint)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), checkpoint / "lit_model.pth")
    _tokenizer(checkpoint)
    samples = [
        {
            "instruction": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
            "input": "",
            "output": " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(WORDS_PER_FIELD)),
        }
        for i in range(SAMPLES)
    ]
    data = root / "data.json"
    data.write_text(json.dumps(samples))
    return checkpoint, data


try:
    from litgpt.data import DataModule
except ImportError:  # litgpt is not installed: make() and TinyTokens are not usable
    DataModule = object


class TinyTokens(DataModule):
    """``litgpt pretrain``'s data: ``blocks`` rows of ``max_seq_length + 1`` random token ids
    (seeded), the shape LitGPT's pretraining modules give, each made when the loader asks for
    it (no dataset held in host memory)."""

    def __init__(self, blocks: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.blocks = blocks
        self.seed = seed
        self.batch_size = 1
        self.max_seq_length = MODEL["block_size"]

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None):
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length or MODEL["block_size"]

    def _loader(self):
        from torch.utils.data import DataLoader

        return DataLoader(_Blocks(self), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()


class _Blocks:
    """Row ``i``: ``max_seq_length + 1`` token ids from a generator seeded with ``seed + i``."""

    def __init__(self, data: TinyTokens) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.blocks

    def __getitem__(self, i: int):
        import torch

        generator = torch.Generator().manual_seed(self.data.seed + i)
        shape = (self.data.max_seq_length + 1,)
        return torch.randint(0, MODEL["vocab_size"], shape, generator=generator)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {sys.argv[0]} DIR")
    for path in make(Path(sys.argv[1])):
        print(path)
