"""A tiny random-init Whisper decoder step with static self- and cross-attention caches.

No weights are downloaded: the model is built from a WhisperConfig. The encoder
output is a fixed random tensor (the decoder is what keeps state). Quantizes
(16a8w by default), lowers for SM8650 with every cache inside the delegate and runs
32 decode steps on the host simulator.

    python scripts/whisper_decoder.py [--quant 8a8w] [--steps 32]
"""

from __future__ import annotations

import sys

import torch
from seq2seq_decoder import EncoderDecoderStep, main

ENCODER_LENGTH = 16
CACHE_LENGTH = 64


def build_model(seed: int = 0) -> EncoderDecoderStep:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=ENCODER_LENGTH,
        max_target_positions=CACHE_LENGTH,
        num_mel_bins=8,
        pad_token_id=0,
        decoder_start_token_id=1,
    )
    model = WhisperForConditionalGeneration(config).eval()
    return EncoderDecoderStep(
        model, head_dim=16, num_heads=4, max_cache_len=CACHE_LENGTH, encoder_len=ENCODER_LENGTH
    ).eval()


if __name__ == "__main__":
    sys.exit(
        main("Whisper decoder (tiny)", __doc__.splitlines()[0], build_model, ENCODER_LENGTH, 64)
    )
