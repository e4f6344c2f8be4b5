"""The documented loops' forward and loss, as ``--loss FILE.py:FUNCTION`` for the estimate.

A loop keeps alive what its variables name until they are assigned again in the next step:
``pred = model(X); loss = loss_fn(pred, y)`` keeps the step's output and loss through backward and
the optimizer step, into the next forward. vramledger's own loop calls a loss function whose
locals die with it, so each function here keeps in :data:`KEPT` what the loop it describes keeps
(``worker.py``), for as long: until the next step's forward and loss replace them. That is the
user's program, given to the estimate as the user's loss code."""

from torch import nn

KEPT: list = []
"""The last step's tensors the loop's variables still name."""


def output_and_loss_kept(model, batch):
    """PyTorch's quickstart and AMP recipe: ``pred``/``output`` and ``loss`` stay named."""
    output = model(batch["x"])
    loss = nn.functional.cross_entropy(output, batch["y"])
    KEPT[:] = [output, loss]
    return loss


def output_kept(model, batch):
    """The DDP tutorial: ``outputs = ddp_model(x)``; ``loss_fn(outputs, labels).backward()``."""
    outputs = model(batch["x"])
    KEPT[:] = [outputs]
    return nn.functional.cross_entropy(outputs, batch["y"])


def loss_kept(model, batch):
    """``loss = loss_fn(model(x), y)`` (FSDP2's and DeepSpeed's examples): only the loss."""
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    KEPT[:] = [loss]
    return loss
