"""A graph deeper than the default C stack frees: ``trace/session.py``'s ``room_for_deep_graphs``.

Autograd frees a graph whose nodes were read from Python (as a trace reads them in backward)
one C recursion per node: a 1,000-layer pipeline stage overflowed the default 8 MiB stack and
the process died with SIGSEGV and no message. Each check runs in a fresh interpreter, with the
limits it names set before anything else."""

import resource
import subprocess
import sys

import pytest

NODES = 150_000
"""Past what the default 8 MiB carries (it overflowed between 40,000 and 100,000 nodes,
``GRAPH_STACK_BYTES``'s docstring), well within what the raised limit carries."""

MIB = 1 << 20
UNLIMITED = resource.RLIM_INFINITY

CHAIN = """
import resource, sys, torch
from vramledger.trace.session import room_for_deep_graphs
resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))
if sys.argv[1] == "raise":
    room_for_deep_graphs()
y = torch.ones(2, requires_grad=True)
for _ in range(int(sys.argv[2])):
    y = y.sin()
    y.grad_fn  # read from Python, as the tracker reads the node running in backward
del y
print("freed")
"""

LIMITS = """
import resource, sys
from vramledger.trace.session import room_for_deep_graphs
resource.setrlimit(resource.RLIMIT_STACK, (int(sys.argv[1]), int(sys.argv[2])))
room_for_deep_graphs()
print(*resource.getrlimit(resource.RLIMIT_STACK))
"""


def _run(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True)


@pytest.mark.slow
def test_a_graph_deeper_than_the_default_stack_frees_after_the_limit_is_raised():
    raised = _run(CHAIN, "raise", NODES)
    assert raised.returncode == 0 and "freed" in raised.stdout, raised.stderr[-2000:]
    # the check means something: the same graph at the default limit kills the process
    plain = _run(CHAIN, "keep", NODES)
    assert plain.returncode < 0, (plain.returncode, plain.stdout)


@pytest.mark.parametrize(
    ("soft", "hard", "after"),
    [
        (8 * MIB, UNLIMITED, (256 * MIB, UNLIMITED)),  # raised to GRAPH_STACK_BYTES
        (8 * MIB, 64 * MIB, (64 * MIB, 64 * MIB)),  # never past the hard limit
        (512 * MIB, UNLIMITED, (512 * MIB, UNLIMITED)),  # never lowered
        (UNLIMITED, UNLIMITED, (UNLIMITED, UNLIMITED)),
    ],
)
def test_the_soft_limit_is_raised_within_the_hard_limit_and_never_lowered(soft, hard, after):
    machine = resource.getrlimit(resource.RLIMIT_STACK)[1]
    if machine != UNLIMITED and (hard == UNLIMITED or hard > machine):
        pytest.skip(f"a process may not raise its hard stack limit past this machine's {machine}")
    done = _run(LIMITS, soft, hard)
    assert done.returncode == 0, done.stderr[-2000:]
    assert tuple(map(int, done.stdout.split())) == after
