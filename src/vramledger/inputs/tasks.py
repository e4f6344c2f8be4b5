"""Hugging Face tasks: which model head a config is trained as, and its default batch.

A task is read from the config's ``architectures`` by looking the class name up in transformers'
own auto mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` ...), so every architecture transformers
knows is trained as what it is. Each task builds the model through its auto class and makes a
default batch from ``--batch-size`` and ``--seq-len`` (``--image-size``): the inputs the model's
forward takes (by its ``main_input_name``) and labels its loss accepts.

``--seq-len`` is the sequence the model's transformer sees: tokens for text; for raw-audio
models (wav2vec2 family) the frames the convolutional feature encoder produces, the waveform
being as long as that takes; for Whisper-style encoders the audio window is fixed by the config
(``2 * max_source_positions`` mel frames) and ``--seq-len`` is the decoder's tokens. An
image-text-to-text model's default batch is text only (its vision tower's parameters, gradients
and optimizer state are counted, its activations are not); pass ``--inputs`` for image batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vramledger.inputs.errors import InputError

Task = Literal[
    "causal-lm",
    "masked-lm",
    "seq2seq-lm",
    "sequence-classification",
    "token-classification",
    "image-classification",
    "audio-classification",
    "ctc",
    "speech-seq2seq",
    "image-text-to-text",
]
TASKS: tuple[str, ...] = Task.__args__  # type: ignore[attr-defined]

Shape = Any  # sources.BatchShape (batch_size, seq_len, image_size)
Make = Callable[[Any, Any, torch.device, Shape], dict[str, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class TaskKind:
    name: str
    auto_class: str
    """transformers auto class that builds the model."""
    mapping: str
    """transformers' architecture table for it (``modeling_auto.<mapping>``)."""
    make: Make
    """(config, model class, device, shape) -> the default batch."""
    uses: frozenset[str]
    """BatchShape fields the default batch follows."""
    note: str | None = None
    """What the default batch leaves out, said in the notes."""


# -- default batches ------------------------------------------------------------------------------
def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


CODE_POINT_MODELS = {"canine": 0x110000}
"""Models whose token ids are Unicode code points, hashed into their embedding buckets (CANINE:
``CanineEmbeddings`` hashes each code point; Unicode has 0x110000), so any code point is an id."""


def vocab_size(config: Any) -> int:
    vocab = getattr(config, "vocab_size", None) or getattr(text_config(config), "vocab_size", None)
    vocab = vocab or CODE_POINT_MODELS.get(getattr(config, "model_type", None))
    if not vocab:
        raise InputError(
            f"the {config.model_type} config has no vocab_size for default token inputs",
            hint="pass --inputs FILE.py:FUNCTION",
        )
    return int(vocab)


def _ids(config: Any, device: torch.device, b: int, s: int) -> torch.Tensor:
    return torch.randint(0, vocab_size(config), (b, s), device=device)


def _classes(config: Any, device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randint(0, int(getattr(config, "num_labels", 2)), shape, device=device)


def _lm(config: Any, cls: Any, device: torch.device, shape: Shape) -> dict[str, torch.Tensor]:
    b, s = shape.batch_size, shape.seq_len
    return {"input_ids": _ids(config, device, b, s), "labels": _ids(config, device, b, s)}


def _sequence_classes(config: Any, cls: Any, device: torch.device, shape: Shape):
    b, s = shape.batch_size, shape.seq_len
    ids = _ids(config, device, b, s)
    eos = getattr(config, "eos_token_id", None)
    if getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
        # encoder-decoder classifiers (BART, T5) pool the last <eos> of every row
        ids[:, -1] = eos
    return {"input_ids": ids, "labels": _classes(config, device, b)}


def _token_classes(config: Any, cls: Any, device: torch.device, shape: Shape):
    b, s = shape.batch_size, shape.seq_len
    return {"input_ids": _ids(config, device, b, s), "labels": _classes(config, device, b, s)}


DEFAULT_IMAGE_SIZE = 224
"""Side of a default image when the config names none (ImageNet's crop)."""


def _vision_attr(config: Any, name: str) -> Any:
    """An image attribute of the config, or of its vision part (CLIP-style models)."""
    value = getattr(config, name, None)
    vision = getattr(config, "vision_config", None)
    if value is None and vision is not None:
        value = getattr(vision, name, None)
    return value


PATCHIFIED_IMAGES = frozenset({"siglip2"})
"""Models that take images cut into patches by their processor (SigLIP 2's NaFlex: ``pixel_values``
of ``(batch, patches, channels * patch_size**2)``, a patch mask and each image's patch grid)."""


def image_input(config: Any, cls: Any) -> Literal["pixels", "patches", "pixel-tokens"]:
    """How an image classifier takes its image: ``pixel_values`` of (batch, channels, height,
    width); patches its processor cuts (``PATCHIFIED_IMAGES``); or one token per pixel (a model
    whose main input is ``input_ids``: ImageGPT's colour clusters)."""
    if config.model_type in PATCHIFIED_IMAGES:
        return "patches"
    if getattr(cls, "main_input_name", None) == "input_ids":
        return "pixel-tokens"
    return "pixels"


def _images(config: Any, cls: Any, device: torch.device, shape: Shape):
    size = shape.image_size or _vision_attr(config, "image_size") or DEFAULT_IMAGE_SIZE
    if isinstance(size, (list, tuple)):
        size = size[0]
    channels = _vision_attr(config, "num_channels") or 3
    b = shape.batch_size
    labels = _classes(config, device, b)
    kind = image_input(config, cls)
    if kind == "patches":
        return {**_patches(config, shape, channels, device), "labels": labels}
    if kind == "pixel-tokens":
        # an image resized to fit the learned positions (32 x 32 for 1024), or --image-size
        side = shape.image_size or math.isqrt(position_limit(config) or 0)
        return {"input_ids": _ids(config, device, b, side * side), "labels": labels}
    return {"pixel_values": torch.randn(b, channels, size, size, device=device), "labels": labels}


def _patches(config: Any, shape: Shape, channels: int, device: torch.device):
    """A square image as SigLIP 2's processor gives it: ``--image-size`` in patches of
    ``patch_size`` per side, else the config's ``num_patches`` (a square grid)."""
    patch = _vision_attr(config, "patch_size")
    side = (
        (shape.image_size // patch)
        if shape.image_size
        else math.isqrt(_vision_attr(config, "num_patches"))
    )
    b, n = shape.batch_size, side * side
    return {
        "pixel_values": torch.randn(b, n, channels * patch * patch, device=device),
        "pixel_attention_mask": torch.ones(b, n, dtype=torch.long, device=device),
        "spatial_shapes": torch.tensor([[side, side]] * b, dtype=torch.long, device=device),
    }


def _conv_input_length(kernels: Sequence[int], strides: Sequence[int], frames: int) -> int:
    """Waveform samples a convolutional feature encoder turns into ``frames`` frames:
    ``L_out = floor((L_in - kernel) / stride) + 1`` per layer, inverted."""
    length = frames
    for kernel, stride in reversed(list(zip(kernels, strides, strict=True))):
        length = (length - 1) * stride + kernel
    return length


CONV_STEMS = {"moonshine": ((127, 7, 3), (64, 3, 2))}
"""Raw-audio encoders whose convolution stem is written in transformers' code rather than their
config, as (kernels, strides): Moonshine's (``modeling_moonshine.py``, ``MoonshineEncoder``:
``conv1`` 127 / 64, ``conv2`` 7 / 3, ``conv3`` 3 / 2)."""


AUDIO_SUBCONFIGS = ("encoder_config", "encoder", "audio_config")
"""Where composite speech configs keep their audio encoder's settings: Parakeet-style CTC and
speech seq2seq models (``encoder_config``), ``SpeechEncoderDecoderConfig`` (``encoder``), CTC
heads over an audio tower (OmniASR: ``audio_config``). Speech LLMs that keep an ``audio_config``
but take ``input_ids`` first (Voxtral, Granite Speech, Qwen3-ASR, ...) interleave audio with text
tokens, which a default batch does not make; they train on a text-only default batch, said in
the notes (``sources.partial_hf_inputs``)."""


def audio_config(config: Any) -> Any:
    """The config that describes the audio input: the config itself, or its audio encoder's."""
    if _describes_audio(config):
        return config
    for name in AUDIO_SUBCONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and not isinstance(sub, dict) and _describes_audio(sub):
            return sub
    return config


def _describes_audio(config: Any) -> bool:
    return bool(
        getattr(config, "model_type", None) in CONV_STEMS
        or (getattr(config, "conv_stride", None) and getattr(config, "conv_kernel", None))
        or getattr(config, "num_mel_bins", None)
        or getattr(config, "input_feat_per_channel", None)
        or getattr(config, "feature_projection_input_dim", None)
    )


def has_audio_inputs(config: Any) -> bool:
    """Whether ``_audio`` can make this config's audio input."""
    return _describes_audio(audio_config(config))


TEXT_ONLY_SPEECH = (
    "default batch is text only (this speech model's audio input is not one vramledger makes): "
    "its audio encoder's parameters, gradients and optimizer state are counted, its activations "
    "are not (pass --inputs for audio batches)"
)


FEATURES_PER_MEL_BIN = {"granite_speech5_encoder": 4}
"""Encoders whose frames carry more features than mel bins: Granite Speech 5's
(``modeling_granite_speech5.py``: ``nn.Linear(config.num_mel_bins * 4, ...)``, each mel frame with
its delta, two frames stacked, as ``GraniteSpeech5FeatureExtractor`` makes them)."""

WAVEFORM_WITH_CHANNEL = frozenset({"omniasr_audio"})
"""Raw-audio encoders that take ``(batch, 1, samples)`` (OmniASR's ``input_values``, fed to its
first ``Conv1d`` as given) rather than wav2vec2's ``(batch, samples)``."""


def _audio(config: Any, cls: Any, device: torch.device, shape: Shape) -> dict[str, torch.Tensor]:
    """The audio input of ``cls`` (by its ``main_input_name``; a composite model's ``inputs``
    named for its encoder's layout) for ``shape.seq_len`` frames."""
    config = audio_config(config)
    batch = _audio_tensor(config, device, shape)
    name = getattr(cls, "main_input_name", None)
    if name in (None, "inputs"):
        name = "input_values" if batch.dim() == 2 else "input_features"
    if config.model_type in WAVEFORM_WITH_CHANNEL:
        batch = batch.unsqueeze(1)
    return {name: batch}


def _audio_tensor(config: Any, device: torch.device, shape: Shape) -> torch.Tensor:
    b, s = shape.batch_size, shape.seq_len
    if getattr(config, "feature_projection_input_dim", None):
        # Wav2Vec2-BERT: stacked log-mel features, frames x feature_projection_input_dim
        return torch.randn(b, s, config.feature_projection_input_dim, device=device)
    if getattr(config, "num_mel_bins", None) and getattr(config, "subsampling_factor", None):
        # Parakeet-style conformer encoders: frames x mel bins, subsampled by the factor
        frames = s * config.subsampling_factor
        return torch.randn(b, frames, config.num_mel_bins, device=device)
    if getattr(config, "conv_stride", None) and getattr(config, "conv_kernel", None):
        samples = _conv_input_length(config.conv_kernel, config.conv_stride, s)
        return torch.randn(b, samples, device=device)
    if config.model_type in CONV_STEMS:
        return torch.randn(b, _conv_input_length(*CONV_STEMS[config.model_type], s), device=device)
    if getattr(config, "num_mel_bins", None) and getattr(config, "max_source_positions", None):
        # Whisper-style: the encoder takes exactly its window of mel frames (two stride-1/2 convs)
        frames = 2 * config.max_source_positions
        return torch.randn(b, config.num_mel_bins, frames, device=device)
    if getattr(config, "num_mel_bins", None) and getattr(config, "max_length", None):
        # spectrogram transformers (AST): frames x mel bins
        return torch.randn(b, config.max_length, config.num_mel_bins, device=device)
    if getattr(config, "input_feat_per_channel", None):
        features = config.input_feat_per_channel * getattr(config, "input_channels", 1)
        layers = len(getattr(config, "conv_kernel_sizes", (5, 5)))
        return torch.randn(b, s * 2**layers, features, device=device)
    if getattr(config, "num_mel_bins", None):
        # conformer encoders that project each frame's features (LASR, Granite Speech 5 CTC):
        # frames x features, one frame per position
        features = config.num_mel_bins * FEATURES_PER_MEL_BIN.get(config.model_type, 1)
        return torch.randn(b, s, features, device=device)
    raise InputError(
        f"no default audio inputs for the {config.model_type} config",
        hint="pass --inputs FILE.py:FUNCTION making its input_features / input_values",
    )


def _audio_classes(config: Any, cls: Any, device: torch.device, shape: Shape):
    return {
        **_audio(config, cls, device, shape),
        "labels": _classes(config, device, shape.batch_size),
    }


CTC_LABEL_FRACTION = 4
"""CTC targets are a quarter as long as the frames (CTC needs at most one label per frame)."""


def _ctc(config: Any, cls: Any, device: torch.device, shape: Shape) -> dict[str, torch.Tensor]:
    b, s = shape.batch_size, shape.seq_len
    length = max(1, s // CTC_LABEL_FRACTION)
    # label 0 is the blank / pad token of the wav2vec2 family's vocabulary
    labels = torch.randint(1, vocab_size(config), (b, length), device=device)
    batch = _audio(config, cls, device, shape)
    (name, features), *_ = batch.items()
    if features.dim() == 3:
        # frame features (and OmniASR's channel-first waveform) come with their feature
        # extractor's mask: the CTC losses of these heads read the input lengths from it
        steps = features.shape[1 if name == "input_features" else -1]
        mask = torch.ones(b, steps, dtype=torch.long, device=device)
        batch[_feature_mask_name(config)] = mask
    return {**batch, "labels": labels}


def _feature_mask_name(config: Any) -> str:
    """What the model's feature extractor calls its mask (``model_input_names``: OmniASR's
    ``padding_mask``), ``attention_mask`` where transformers cannot say."""
    from transformers.models.auto import feature_extraction_auto as auto

    name = auto.FEATURE_EXTRACTOR_MAPPING_NAMES.get(config.model_type)
    try:
        names = auto.feature_extractor_class_from_name(name).model_input_names if name else []
    except ImportError:  # an extractor needing a package not installed (torchaudio)
        names = []
    return next((n for n in names if n.endswith("mask")), "attention_mask")


def _speech_seq2seq(config: Any, cls: Any, device: torch.device, shape: Shape):
    b, s = shape.batch_size, shape.seq_len
    return {**_audio(config, cls, device, shape), "labels": _ids(config, device, b, s)}


TEXT = frozenset({"batch_size", "seq_len"})
KINDS: dict[str, TaskKind] = {
    kind.name: kind
    for kind in (
        TaskKind(
            name="causal-lm",
            auto_class="AutoModelForCausalLM",
            mapping="MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            make=_lm,
            uses=TEXT,
        ),
        TaskKind(
            name="masked-lm",
            auto_class="AutoModelForMaskedLM",
            mapping="MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            make=_lm,
            uses=TEXT,
        ),
        TaskKind(
            name="seq2seq-lm",
            auto_class="AutoModelForSeq2SeqLM",
            mapping="MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            make=_lm,
            uses=TEXT,
        ),
        TaskKind(
            name="sequence-classification",
            auto_class="AutoModelForSequenceClassification",
            mapping="MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            make=_sequence_classes,
            uses=TEXT,
        ),
        TaskKind(
            name="token-classification",
            auto_class="AutoModelForTokenClassification",
            mapping="MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
            make=_token_classes,
            uses=TEXT,
        ),
        TaskKind(
            name="image-classification",
            auto_class="AutoModelForImageClassification",
            mapping="MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            make=_images,
            uses=frozenset({"batch_size", "image_size"}),
        ),
        TaskKind(
            name="audio-classification",
            auto_class="AutoModelForAudioClassification",
            mapping="MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
            make=_audio_classes,
            uses=TEXT,
        ),
        TaskKind(
            name="ctc",
            auto_class="AutoModelForCTC",
            mapping="MODEL_FOR_CTC_MAPPING_NAMES",
            make=_ctc,
            uses=TEXT,
        ),
        TaskKind(
            name="speech-seq2seq",
            auto_class="AutoModelForSpeechSeq2Seq",
            mapping="MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
            make=_speech_seq2seq,
            uses=TEXT,
        ),
        TaskKind(
            name="image-text-to-text",
            auto_class="AutoModelForImageTextToText",
            mapping="MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            make=_lm,
            uses=TEXT,
            note="default batch is text only: the vision tower's parameters, gradients and "
            "optimizer state are counted, its activations are not (pass --inputs for images)",
        ),
    )
}
assert tuple(KINDS) == TASKS

_INFERENCE_ORDER = (
    "causal-lm",
    "seq2seq-lm",
    "speech-seq2seq",
    "image-text-to-text",
    "masked-lm",
    "ctc",
    "audio-classification",
    "image-classification",
    "sequence-classification",
    "token-classification",
)
"""When an architecture appears in several tables, the first of these wins."""


def infer_task(config: Any) -> str:
    """The task of the first of the config's ``architectures`` that transformers' auto mappings
    place (``GPT2LMHeadModel`` -> causal-lm, ``WhisperForConditionalGeneration`` ->
    speech-seq2seq, ``Gemma3ForConditionalGeneration`` -> image-text-to-text)."""
    from transformers.models.auto import modeling_auto

    for arch in getattr(config, "architectures", None) or ():
        for name in _INFERENCE_ORDER:
            table = getattr(modeling_auto, KINDS[name].mapping, {})
            if arch in _class_names(table):
                return name
    raise InputError(
        f"cannot tell the task of this {config.model_type} config from its architectures "
        f"{getattr(config, 'architectures', None)} (no head that transformers maps to a task)",
        hint=f"pass --task (one of {', '.join(TASKS)})",
    )


def _class_names(table: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for value in table.values():
        out.update(value if isinstance(value, (list, tuple)) else (value,))
    return out


def model_class(config: Any, task: str) -> Any:
    """The class the task's auto class builds for ``config`` (None if it has none)."""
    import transformers

    auto = getattr(transformers, KINDS[task].auto_class)
    try:
        return auto._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


def position_limit(config: Any) -> int | None:
    """Sequence limit a text config declares (``max_position_embeddings`` ...), if any."""
    text = text_config(config)
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0 and not math.isinf(value):
            return value
    return None
