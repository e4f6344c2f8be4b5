"""What torchtitan's debug model reads, made in a folder, for `-m torchtitan.train` under
`vramledger run --nproc-per-node 2` (tests/test_run_torchtitan.py, benchmarks/programs.py):

    python tests/programs/torchtitan_tiny.py DIR

makes ``DIR/tests/assets/tokenizer`` (a byte-level BPE tokenizer trained here, with the
``tokenizers`` library, on the words of the data below: ``tokenizer.json`` and a
``tokenizer_config.json`` naming ``<|begin_of_text|>`` and ``<|end_of_text|>`` as its bos and
eos tokens; where torchtitan's debug model looks for its tokenizer, ``--model.hf_assets_path``'s
default) and ``DIR/tests/assets/c4_test/data.json`` (64 rows of text, where torchtitan's
``c4_test`` dataset is read from). Nothing is read from torchtitan's repository (its wheel lacks
its test tokenizer and, for 0.2, its ``debug_model.toml``: ``DEBUG_MODEL_02`` gives that config's
settings as flags instead) and nothing is downloaded. Run it there with

    torchrun --nproc-per-node 2 -m torchtitan.train <DEBUG_MODEL_02>   # 0.2
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

TOKENIZER_DIR = "tests/assets/tokenizer"
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
VOCAB_SIZE = 512
"""The tokenizer's most tokens (its 256 bytes, bos, eos and merges; these words need fewer):
within the 2048 of torchtitan 0.2's llama3 ``debugmodel`` flavor, whose embedding its token ids
index."""
DATA_DIR = "tests/assets/c4_test"
DATA_ROWS = 64
DEBUG_MODEL_02 = (
    *("--job.description", "Llama 3 debug training"),
    *("--profiling.save_traces_folder", "profile_trace"),
    *("--metrics.log_freq", "1"),
    *("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.8"),
    *("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
    *("--checkpoint.interval", "10", "--checkpoint.no-last-save-model-only"),
    *("--quantize.linear.float8.filter_fqns", "output"),
    *("--validation.freq", "5", "--validation.steps", "10"),
)
"""torchtitan 0.2's llama3 debug model config (v0.2.2's
``torchtitan/models/llama3/train_configs/debug_model.toml``) as flags: those of its settings
that differ from 0.2.2's defaults (torchtitan/config/job_config.py), which already name the
llama3 ``debugmodel``, ``./tests/assets/tokenizer``, ``c4_test``, AdamW at lr 8e-4, FSDP over
every rank and selective activation checkpointing; its ``[training]`` steps (10), seq_len and
local_batch_size are left to the caller (0.3 names its configs in Python: ``--config``)."""
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "he",
    "it",
    "an",
    "are",
]


def version() -> tuple[int, ...]:
    """The installed torchtitan's version, as numbers. Read without importing torchtitan: 0.2
    binds ``sys.argv[1:]`` as ``ConfigManager.parse_args``'s default when it is imported, so
    the program must be the first to import it."""
    return tuple(int(part) for part in importlib.metadata.version("torchtitan").split(".")[:3])


def texts() -> list[str]:
    """The rows of ``c4_test``: 400 of ``WORDS`` each."""
    return [
        " ".join(WORDS[(row * 7 + i) % len(WORDS)] for i in range(400)) for row in range(DATA_ROWS)
    ]


def make_tokenizer(folder: Path) -> None:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder, as torchtitan's test tokenizer has)
    trained on ``texts()``, bos and eos its first two tokens, in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make(folder: Path) -> None:
    """The tokenizer and data in ``folder``."""
    make_tokenizer(folder / TOKENIZER_DIR)
    (folder / DATA_DIR).mkdir(parents=True, exist_ok=True)
    with open(folder / DATA_DIR / "data.json", "w") as f:
        for text in texts():
            f.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    make(Path(sys.argv[1]))
