"""The tracer: fake tensors, the dispatch-level storage tracker, and where a fake run must be
corrected to allocate as a real one does (autograd's plain paths, kernels' scratch, values)."""
