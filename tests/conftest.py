import atexit
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramledger.inputs.host_cpu import THREAD_VARIABLES

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
# The suite never touches the user's cache, and traces unless a test turns the cache on
# (tests/test_trace_cache.py): tests that patch the tracer must see it run.
_CACHE = tempfile.mkdtemp(prefix="vramledger-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["VRAMLEDGER_CACHE_DIR"] = _CACHE
os.environ["VRAMLEDGER_NO_CACHE"] = "1"

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> str:
    return str(FIXTURES / name)


MODELS_PY = fixture("models.py")


@pytest.fixture(autouse=True)
def _piped_output(monkeypatch):
    """Every test's output as when piped, whatever the terminal running the suite: ``COLUMNS``
    (set by some terminals, and by pytest-xdist's workers) would wrap the CLI's lines. A test
    that needs a width sets it."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _threads_kept():
    """No test leaves the process's intra-op thread count (or the variables that set it in the
    processes it spawns) changed: later tests' CPU kernel scratch, estimated and real, depends on
    it (``trace/core/cpu_scratch.py``), so a leak makes them depend on which tests ran before on
    their worker."""
    import torch

    before = (torch.get_num_threads(), *(os.environ.get(n) for n in THREAD_VARIABLES))
    yield
    after = (torch.get_num_threads(), *(os.environ.get(n) for n in THREAD_VARIABLES))
    assert after == before, (
        f"the test changed the threads (count, {THREAD_VARIABLES}): {before} -> {after}"
    )


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, and give the caller's count back after
    (as ``_threads_kept`` requires of every test)."""
    import torch

    caller = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(caller)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


MULTIPROCESS_GROUP = "multiprocess"
"""Under pytest-xdist (``--dist loadgroup``, the README's test command), every test marked
``multiprocess`` runs on one worker, one after another: their real gloo runs are cached per
world size and shared between files (``tests/mesh_real.py``), and two sets of gloo processes at
once would only fight for the cores. Every other test is grouped by its file, so a file's cached
traces are made once."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            multiprocess = item.get_closest_marker("multiprocess") is not None
            item.add_marker(
                pytest.mark.xdist_group(MULTIPROCESS_GROUP if multiprocess else item.path.name)
            )
