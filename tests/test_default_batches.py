"""Default batches for architectures whose inputs are not plain tokens or images, checked against
the model's own code: each config is built by its transformers config class (small sizes), the
model by its auto class, and the default batch must train it in a plain PyTorch step (the model
decides what it accepts, not this file). Found by the zoo sweep (benchmarks/zoo.py), where each
of these failed before: CTC conformer heads (frame features and the feature extractor's mask),
OmniASR's channel-first waveform, a speech encoder-decoder's ``inputs``, Moonshine's
convolution stem, CANINE's code points, SigLIP 2's patches, ImageGPT's pixel tokens."""

import pytest
import torch
import transformers

from vramledger.inputs.sources import BatchShape
from vramledger.inputs.tasks import KINDS, model_class

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
CONFORMER = dict(**SMALL, subsampling_conv_channels=16)
CONV_STACK = dict(conv_dim=[32] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)


def _speech_encoder_decoder() -> transformers.PretrainedConfig:
    encoder = transformers.Wav2Vec2Config(**SMALL, **CONV_STACK)
    decoder = transformers.BertConfig(**SMALL, vocab_size=64, is_decoder=True)
    decoder.add_cross_attention = True
    config = transformers.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = config.pad_token_id = 0
    return config


CASES = {
    "parakeet_ctc": ("ctc", lambda: transformers.ParakeetCTCConfig(encoder_config=CONFORMER)),
    "lasr_ctc": ("ctc", lambda: transformers.LasrCTCConfig(encoder_config=CONFORMER)),
    "granite_speech5_ctc": (
        "ctc",
        lambda: transformers.GraniteSpeech5CTCConfig(encoder_config=dict(**SMALL, head_dim=16)),
    ),
    "omniasr_ctc": (
        "ctc",
        lambda: transformers.OmniASRCTCConfig(audio_config=dict(**SMALL, **CONV_STACK)),
    ),
    "speech-encoder-decoder": ("speech-seq2seq", _speech_encoder_decoder),
    "moonshine": (
        "speech-seq2seq",
        lambda: transformers.MoonshineConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            encoder_num_hidden_layers=1,
            decoder_num_hidden_layers=1,
            encoder_num_attention_heads=2,
            decoder_num_attention_heads=2,
            pad_token_id=2,
        ),
    ),
    "canine": (
        "sequence-classification",
        lambda: transformers.CanineConfig(**SMALL, num_hash_buckets=64, pad_token_id=0),
    ),
    "imagegpt": (
        "image-classification",
        lambda: transformers.ImageGPTConfig(n_embd=32, n_layer=1, n_head=2, n_positions=64),
    ),
    "siglip2": (
        "image-classification",
        lambda: transformers.Siglip2Config(
            text_config=SMALL, vision_config=dict(**SMALL, num_patches=16, patch_size=4)
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_batch_trains_the_model(name):
    task, make_config = CASES[name]
    config = make_config()
    assert config.model_type == name
    cls = model_class(config, task)
    torch.manual_seed(0)
    batch = KINDS[task].make(config, cls, torch.device("cpu"), BatchShape(batch_size=2, seq_len=16))
    model = getattr(transformers, KINDS[task].auto_class).from_config(config)
    model.train()
    loss = model(**batch).loss
    assert loss is not None and torch.isfinite(loss), (name, loss)
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())
