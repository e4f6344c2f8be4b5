"""QLoRA as people write it: a causal LM from a local folder (first argument) loaded with
bitsandbytes' quantization (second argument: nf4, fp4 or int8) straight onto the GPU, prepared
with peft's prepare_model_for_kbit_training, LoRA on q_proj and v_proj, AdamW for three steps.
The same model and settings as `vramledger estimate FOLDER --seq-len 64 --lora
r=8,alpha=16,targets=q_proj,v_proj --quantize KIND --precision bf16-true`."""

import sys

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

folder = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "nf4"
if kind == "int8":
    quantization = BitsAndBytesConfig(load_in_8bit=True)
else:
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
model = AutoModelForCausalLM.from_pretrained(
    folder, quantization_config=quantization, dtype=torch.bfloat16, device_map="cuda"
)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="none")
model = get_peft_model(model, lora)
model.train()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
vocab = model.config.vocab_size
batch = {
    "input_ids": torch.randint(0, vocab, (1, 64), device="cuda"),
    "labels": torch.randint(0, vocab, (1, 64), device="cuda"),
}
for _ in range(3):
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()
print(f"{kind} QLoRA peak bytes:", torch.cuda.max_memory_allocated())
