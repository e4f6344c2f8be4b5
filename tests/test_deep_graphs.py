"""A graph deeper than the default C stack frees: ``trace/session.py``'s ``room_for_deep_graphs``.

Autograd frees a graph whose nodes were read from Python (as a trace reads them in backward)
one C recursion per node: a 1,000-layer pipeline stage overflowed the default 8 MiB stack and
the process died with SIGSEGV and no message. Each check runs in a fresh interpreter, which
starts at the default limit (``ulimit -s`` 8192 here)."""

import subprocess
import sys

import pytest

NODES = 150_000
"""Past what the default 8 MiB carries (it overflowed between 40,000 and 100,000 nodes,
``GRAPH_STACK_BYTES``'s docstring), well within what the raised limit carries."""

CHAIN = f"""
import resource, torch
from vramledger.trace.session import room_for_deep_graphs
resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))
if {{raise_limit}}:
    room_for_deep_graphs()
y = torch.ones(2, requires_grad=True)
for _ in range({NODES}):
    y = y.sin()
    y.grad_fn  # read from Python, as the tracker reads the node running in backward
del y
print("freed")
"""


def _run(raise_limit: bool) -> subprocess.CompletedProcess[str]:
    code = CHAIN.format(raise_limit=raise_limit)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.slow
def test_a_graph_deeper_than_the_default_stack_frees_after_the_limit_is_raised():
    raised = _run(True)
    assert raised.returncode == 0 and "freed" in raised.stdout, raised.stderr[-2000:]
    # the check means something: the same graph at the default limit kills the process
    plain = _run(False)
    assert plain.returncode < 0, (plain.returncode, plain.stdout)


def test_the_limit_is_raised_never_lowered():
    import resource

    from vramledger.trace.session import GRAPH_STACK_BYTES, room_for_deep_graphs

    before = resource.getrlimit(resource.RLIMIT_STACK)
    room_for_deep_graphs()
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    assert hard == before[1]
    if before[0] == resource.RLIM_INFINITY:
        assert soft == resource.RLIM_INFINITY
    else:
        room = GRAPH_STACK_BYTES if hard == resource.RLIM_INFINITY else min(GRAPH_STACK_BYTES, hard)
        assert soft == max(before[0], room)
