"""A small Mixtral whose experts run as transformers' eager loop (one matmul per expert over the
tokens routed to it): what the step allocates depends on how the router splits the tokens.

    vramledger estimate examples/mixtral_eager_experts.py:model \
        --inputs examples/mixtral_eager_experts.py:inputs \
        --loss examples/mixtral_eager_experts.py:loss --target cpu --moe-routing worst
"""

import torch


def model():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    return MixtralForCausalLM(config)


def inputs(device, batch_size=4, seq_len=128):
    ids = torch.randint(0, 1024, (batch_size, seq_len), device=device)
    return {"input_ids": ids, "labels": ids}


def loss(model, batch):
    return model(**batch).loss
