"""The record of a run's allocations (``timeline.py``'s ``Timeline``) and the allocator models that
replay it. The tracer writes into a ``Timeline``, so the record sits below the trace."""
