"""Fine-tunes a model named on the Hub: from_pretrained downloads it when it is not cached."""

import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "gpt2")
model.to("cuda")
optimizer = torch.optim.AdamW(model.parameters())
