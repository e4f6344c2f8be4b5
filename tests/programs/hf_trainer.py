"""transformers' Trainer on a tiny Llama and a dataset of random tokens, no checkpoint saved,
no reporting."""

import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
model = LlamaForCausalLM(config)


class Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 512, (64,))
        return {"input_ids": ids, "labels": ids}


args = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=2,
    max_steps=4,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
print("trainer peak bytes:", torch.cuda.max_memory_allocated())
