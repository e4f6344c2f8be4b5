"""What to run: the spec and its fields, the readers of foreign configs (DeepSpeed, accelerate,
Hub configs, users' programs), recipes, sources, GPUs, precision, optimizers, the training step,
the vocabulary of memory categories, errors and units. The bottom floor: it imports no other
floor."""
