"""Predictions: vramledger's own training step on fake tensors (``step.py``, ``estimate``) and the
user's program traced as it runs (``program.py``, ``run``), with their optimizer windows."""
