"""The model-zoo sweep behind ``benchmarks/zoo.py``: settings, shrinking, cases, workers, results."""
