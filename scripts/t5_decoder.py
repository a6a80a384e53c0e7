"""A tiny random-init T5 decoder step with static self- and cross-attention caches.

Built from a T5Config (no download). T5's relative position buckets are integer
arithmetic done in float (log of a distance, truncated to a bucket id); qnn_mutbuf
keeps that part unquantized so buckets stay exact. Quantizes (16a8w by default),
lowers for SM8650 with every cache inside the delegate and runs 32 decode steps on
the host simulator.

    python scripts/t5_decoder.py [--quant 8a8w] [--steps 32]
"""

from __future__ import annotations

import sys

import torch
from seq2seq_decoder import EncoderDecoderStep, main

ENCODER_LENGTH = 16
CACHE_LENGTH = 64


def build_model(seed: int = 0) -> EncoderDecoderStep:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    # num_layers is what StaticCache sizes itself from, so it matches the decoder's.
    config = T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        decoder_start_token_id=0,
        dropout_rate=0.0,
    )
    model = T5ForConditionalGeneration(config).eval()
    return EncoderDecoderStep(
        model, head_dim=16, num_heads=4, max_cache_len=CACHE_LENGTH, encoder_len=ENCODER_LENGTH
    ).eval()


if __name__ == "__main__":
    sys.exit(main("T5 decoder (tiny)", __doc__.splitlines()[0], build_model, ENCODER_LENGTH, 64))
