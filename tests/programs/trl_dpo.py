"""TRL's DPOTrainer on a tiny Llama with its reference model (a frozen copy of the policy's
initial weights, given as ``ref_model``: without one TRL loads it by the model's Hub name), a
word-level tokenizer and preference pairs of random words made here (no downloads, no saves)."""

import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

torch.manual_seed(0)
random.seed(0)
WORDS = [f"w{i}" for i in range(500)]
vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
)


def words(k):
    return " ".join(random.choices(WORDS, k=k))


pairs = {"prompt": [], "chosen": [], "rejected": []}
for _ in range(32):
    pairs["prompt"].append(words(16))
    pairs["chosen"].append(words(24))
    pairs["rejected"].append(words(24))
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
args = DPOConfig(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=2,
    max_steps=4,
    max_length=64,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
model = LlamaForCausalLM(config)
ref_model = LlamaForCausalLM(config)
ref_model.load_state_dict(model.state_dict())
trainer = DPOTrainer(
    model=model,
    ref_model=ref_model,
    args=args,
    train_dataset=Dataset.from_dict(pairs),
    processing_class=tokenizer,
)
trainer.train()
print("dpo peak bytes:", torch.cuda.max_memory_allocated())
