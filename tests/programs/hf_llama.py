"""A tiny Llama from transformers, trained from its config with AdamW; logs its loss."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
model = LlamaForCausalLM(config).to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(3):
    ids = torch.randint(0, 512, (2, 64)).to("cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
print("llama peak bytes:", torch.cuda.max_memory_allocated())
