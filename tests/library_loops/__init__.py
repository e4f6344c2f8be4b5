"""Training loops written the way their libraries document them, run with no vramledger code in
the measuring process (``worker.py``), as the truth ``tests/test_library_loops.py`` checks
estimates against."""
