"""Precision names mean what the users' frameworks mean by them (precision.py)."""

import pytest

from vramledger.inputs.errors import InputError
from vramledger.inputs.precision import PRECISIONS, precision_policy
from vramledger.inputs.spec import TrainingSpec


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("32-true", "fp32"),
        ("fp32", "fp32"),
        ("bf16-mixed", "bf16-mixed"),
        ("bf16", "bf16-mixed"),
        ("16-mixed", "16-mixed"),
        ("16", "16-mixed"),
        ("bf16-true", "bf16-true"),
        ("bf16-master", "bf16-master"),
    ],
)
def test_framework_names(name: str, mode: str) -> None:
    assert TrainingSpec(model="x.json", precision=name).precision == mode


def test_lightning_meanings() -> None:
    """Lightning's bf16-mixed and 16-mixed are autocast over fp32 weights; bf16-true is bf16
    weights with no master copy; the master-weight modes keep an fp32 copy."""
    assert precision_policy("bf16-mixed").param_dtype.itemsize == 4
    assert precision_policy("bf16-mixed").autocast_dtype is not None
    assert precision_policy("16-mixed").loss_scaling
    assert not precision_policy("bf16-true").master_weights
    assert precision_policy("bf16-master").master_weights
    assert precision_policy("bf16-master").param_dtype.itemsize == 2
    assert all(p.models for p in PRECISIONS.values())


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("bf16-autocast", "bf16-mixed"),
        ("fp16-autocast", "16-mixed"),
        ("bf16-pure", "bf16-true"),
        ("fp16-mixed", "fp16-master"),
    ],
)
def test_old_spellings_refused_with_the_new_name(old: str, new: str) -> None:
    with pytest.raises(InputError, match=f"is now called '{new}'"):
        TrainingSpec(model="x.json", precision=old)
