"""Tracing: run a real training step on fake tensors and record every storage (the Timeline)."""
