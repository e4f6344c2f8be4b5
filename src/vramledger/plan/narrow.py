"""Narrower copies of a Hugging Face config, for rehearsals the user allows to be narrow.

A copy ``fraction`` as wide keeps the vocabulary, the sequence and the width of each attention
head (a stated ``head_dim`` is left as it is; otherwise width and head count scale together),
and scales the model width, the feed-forward width and the number of query and key/value
heads. Every tensor then has the same shapes along the sequence and the heads' inner dimension,
and its size is a polynomial of at most degree two in the fraction (weights: width × width;
activations: width; logits: neither), which is what ``rehearse`` fits.
"""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

from vramledger.inputs.errors import InputError

WIDTH_ATTRS = ("hidden_size", "n_embd", "d_model", "dim")
"""Model width, by the names Hugging Face configs use for it."""
FEED_FORWARD_ATTRS = ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "hidden_dim")
"""Feed-forward width (``None`` in GPT-2 means 4 × width, which scales by itself)."""
HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads")
"""Head counts: scaled too, so that each head keeps its width."""


def narrow_config(config: Any, fraction: float) -> Any:
    """A copy of ``config`` ``fraction`` as wide (0 < fraction < 1)."""
    share = Fraction(fraction).limit_denominator(64)
    if not 0 < share < 1:
        raise InputError(
            f"--widths takes fractions of the model's width between 0 and 1, not {fraction}",
            hint="--widths 0.25,0.5,0.75",
        )
    out = copy.deepcopy(config)
    widths = [a for a in WIDTH_ATTRS if isinstance(getattr(config, a, None), int)]
    heads = [a for a in HEAD_ATTRS if isinstance(getattr(config, a, None), int)]
    if not widths or not heads:
        raise InputError(
            f"cannot make a narrower copy of a {type(config).__name__}: no width or head count "
            "found in it",
            hint="rehearse with --depths only",
        )
    for attr in (*widths, *heads, *FEED_FORWARD_ATTRS):
        value = getattr(config, attr, None)
        if not isinstance(value, int):
            continue
        scaled = value * share
        if scaled.denominator != 1 or scaled < 1:
            raise InputError(
                f"{float(share):g} of {attr} = {value} is not a whole number",
                hint="use fractions that divide every head count, e.g. --widths 0.25,0.5,0.75 "
                "for 8 heads and 4 key/value heads",
            )
        setattr(out, attr, int(scaled))
    return out
