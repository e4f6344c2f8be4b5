"""TRL's SFTTrainer on a tiny Llama, a word-level tokenizer and a dataset of random text made
here (no downloads, no saves). SFTConfig's defaults: bf16 autocast, activation checkpointing,
and TRL's chunked log-prob head (its fused_lm_head path) for the loss, entropy and accuracy."""

import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

torch.manual_seed(0)
random.seed(0)
WORDS = [f"w{i}" for i in range(500)]
vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
)
texts = [" ".join(random.choices(WORDS, k=48)) for _ in range(32)]
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
args = SFTConfig(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=2,
    max_steps=4,
    max_length=64,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
trainer = SFTTrainer(
    model=LlamaForCausalLM(config),
    args=args,
    train_dataset=Dataset.from_dict({"text": texts}),
    processing_class=tokenizer,
)
trainer.train()
print("sft peak bytes:", torch.cuda.max_memory_allocated())
