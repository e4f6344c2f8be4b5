"""Checks of a request before anything is traced.

What cannot work is refused (``InputError``: one line saying what to do); what can run but is
probably not what the user meant is answered with a warning that the result carries
(``Ledger.warnings``) and the CLI prints first. Each check is about the request as given, so a
hint never suggests what the user already did.
"""

from __future__ import annotations

from vramledger.inputs.recipe import Recipe
from vramledger.inputs.tasks import position_limit


def request_warnings(recipe: Recipe) -> list[str]:
    """Warnings about a request that will run but is probably not what was meant."""
    spec = recipe.spec
    out: list[str] = []
    config = recipe.source.config
    if config is not None and "seq_len" in recipe.make_inputs.uses:
        limit = position_limit(config)
        if limit is not None and spec.seq_len > limit:
            out.append(
                f"seq-len {spec.seq_len:,} exceeds the {limit:,} positions the config declares: "
                "the model was not trained for it (rotary scaling aside); "
                f"the estimate runs it as asked — pass --seq-len {limit} or less for its own range"
            )
    single = spec.world_size == 1 and not spec.parallelism.offloads
    if spec.parallelism.shards_optimizer_state and single:
        out.append(
            f"--strategy {spec.strategy} on 1 rank shards nothing (the rank holds everything); "
            "pass --world-size N (or --nodes and --gpus-per-node) for the ranks it shards over"
        )
    return out
