"""The user's own program under the trace: its run, its tracker, its repeated blocks and the host
tensors it keeps."""
