# ruff: noqa
# A tiny configuration of karpathy/nanoGPT's train.py for tests/test_run_program.py and
# benchmarks/programs.py (data made by them in data/tiny). nanoGPT itself is not shipped here: set
# VRAMLEDGER_NANOGPT to a checkout of it (train.py, model.py, configurator.py).
out_dir = "out-tiny"
dataset = "tiny"
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
batch_size = 4
gradient_accumulation_steps = 2
max_iters = 3
lr_decay_iters = 3
warmup_iters = 1
eval_interval = 2
eval_iters = 1
log_interval = 1
compile = False
dropout = 0.0
always_save_checkpoint = True
dtype = "float32"
