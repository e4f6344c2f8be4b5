"""Answering "how many GPUs, and what should I change?": plan, advise, rehearse."""
