"""The heads swept and the (architecture, head) cases, from transformers' own auto mappings."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .settings import SAMPLE_SEED


@dataclass(frozen=True)
class Head:
    task: str
    """vramledger's task name (a name of our own where vramledger has none)."""
    mapping: str
    """transformers.models.auto.modeling_auto's mapping from model type to class name."""
    auto_class: str
    """The transformers Auto class whose ``from_config`` builds it (as vramledger does)."""
    default: bool = True
    """Swept unless ``--tasks`` names the heads."""


HEADS = (
    Head("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    Head("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    Head("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    Head(
        "image-classification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForImageClassification",
    ),
    Head(
        "sequence-classification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForSequenceClassification",
    ),
    Head(
        "audio-classification",
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForAudioClassification",
    ),
    Head("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    Head("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    Head(
        "token-classification",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForTokenClassification",
        default=False,
    ),
    Head(
        "image-text-to-text",
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "AutoModelForImageTextToText",
        default=False,
    ),
)


def head_of(task: str) -> Head:
    return next(h for h in HEADS if h.task == task)


DISTRIBUTED_SAMPLE = (
    ("llama", "causal-lm"),
    ("gpt2", "causal-lm"),
    ("bert", "masked-lm"),
    ("t5", "seq2seq-lm"),
    ("vit", "image-classification"),
    ("qwen2", "sequence-classification"),
)
DISTRIBUTED_STRATEGIES = ("ddp", "fsdp")
DISTRIBUTED_WORLD = 2


@dataclass(frozen=True, order=True)
class Case:
    arch: str
    """The model type (``config.model_type``)."""
    task: str
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.arch}:{self.task}"


def enumerate_cases(tasks: set[str] | None = None) -> list[Case]:
    """Every (model type, head) pair in transformers' auto mappings, sorted."""
    from transformers.models.auto import modeling_auto

    cases = set()
    for head in HEADS:
        if (head.task not in tasks) if tasks else not head.default:
            continue
        for arch, names in getattr(modeling_auto, head.mapping).items():
            name = names if isinstance(names, str) else names[0]
            cases.add(Case(arch, head.task, name))
    return sorted(cases)


def select_cases(
    cases: list[Case],
    only: set[str] | None = None,
    sample: int | None = None,
    names: list[str] | None = None,
) -> list[Case]:
    if names:
        by_name = {c.name: c for c in cases}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"--cases: no such (architecture:head) case: {unknown}")
        cases = [by_name[n] for n in names]
    if only:
        unknown = only - {c.arch for c in cases}
        if unknown:
            raise SystemExit(f"--only: no such architecture in the mappings: {sorted(unknown)}")
        cases = [c for c in cases if c.arch in only]
    if sample is not None and sample < len(cases):
        cases = sorted(random.Random(SAMPLE_SEED).sample(cases, sample))
    return cases


def supported_tasks() -> tuple[str, ...]:
    """vramledger's task names (``vramledger.inputs.tasks.TASKS``; older versions:
    ``vramledger.inputs.sources.TASKS``)."""
    try:
        from vramledger.inputs.tasks import TASKS
    except ImportError:
        from vramledger.inputs.sources import TASKS
    return tuple(TASKS)
