"""A timeline replayed into the ledger: peaks, categories, the modules at the peak."""
