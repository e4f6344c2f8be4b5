"""A Llama built by transformers' own code from a config file (its first argument; the second,
the sequence length), moved to the GPU in bf16 and trained with AdamW for three steps on random
tokens; prints its peak."""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig.from_json_file(sys.argv[1])
seq = int(sys.argv[2]) if len(sys.argv) > 2 else 512
model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(3):
    ids = torch.randint(0, config.vocab_size, (1, seq)).to("cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
print("llama peak bytes:", torch.cuda.max_memory_allocated())
