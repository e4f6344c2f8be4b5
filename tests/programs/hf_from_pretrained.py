"""A causal LM from a local folder (its argument), as people fine-tune one: from_pretrained,
to the GPU, AdamW, a few steps."""

import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda")
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64)).to("cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("pretrained peak bytes:", torch.cuda.max_memory_allocated())
