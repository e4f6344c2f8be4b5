"""Resumes a LoRA fine-tune: the base model from a local folder, its adapter from another
(arguments: the two folders), trained with AdamW for three steps."""

import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda")
model = PeftModel.from_pretrained(model, sys.argv[2], is_trainable=True)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("adapter peak bytes:", torch.cuda.max_memory_allocated())
