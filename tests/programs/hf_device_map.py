"""A causal LM from a local folder (its argument) loaded in bf16 straight onto the GPU
(device_map="cuda"), then trained with AdamW for two steps."""

import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda")
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(2):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("device_map peak bytes:", torch.cuda.max_memory_allocated())
