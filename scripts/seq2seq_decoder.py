"""A decoder step of an encoder-decoder model with static self- and cross-attention caches.

Shared by whisper_decoder.py and t5_decoder.py. Both KV caches are registered
buffers (StaticCache layers), so export sees them as mutable state:

* self-attention: written at ``cache_position`` every step (``index_copy_``);
* cross-attention: rewritten every step from ``encoder_hidden_states`` (transformers
  skips that once its Python-side ``is_updated`` flag is set, which export would bake
  in, so the flag is cleared at the start of every step).
"""

from __future__ import annotations

import argparse

import torch


class EncoderDecoderStep(torch.nn.Module):
    """(input_ids, encoder_hidden_states, cache_position) -> logits."""

    def __init__(self, model, head_dim: int, num_heads: int, max_cache_len: int, encoder_len: int):
        super().__init__()
        from transformers.cache_utils import EncoderDecoderCache, StaticCache

        config = model.config
        self.decoder = model.get_decoder()
        self.head = getattr(model, "proj_out", None) or model.lm_head
        self.self_cache = StaticCache(config=config, max_cache_len=max_cache_len)
        self.cross_cache = StaticCache(config=config, max_cache_len=encoder_len)
        for cache in (self.self_cache, self.cross_cache):
            cache.early_initialization(1, num_heads, head_dim, torch.float32, "cpu")
        for kind, cache in (("self", self.self_cache), ("cross", self.cross_cache)):
            for index, layer in enumerate(cache.layers):
                self.register_buffer(f"{kind}_key_{index}", layer.keys, persistent=False)
                self.register_buffer(f"{kind}_value_{index}", layer.values, persistent=False)
                self.register_buffer(
                    f"{kind}_length_{index}", layer.cumulative_length, persistent=False
                )
        self.cache = EncoderDecoderCache(self.self_cache, self.cross_cache)

    def forward(self, input_ids, encoder_hidden_states, cache_position):
        for layer in self.self_cache.layers:
            layer.cumulative_length.copy_(cache_position[0])
        for layer in self.cross_cache.layers:
            layer.cumulative_length.zero_()
        for index in self.cache.is_updated:
            self.cache.is_updated[index] = False
        outputs = self.decoder(
            input_ids=input_ids,
            encoder_hidden_states=encoder_hidden_states,
            past_key_values=self.cache,
            use_cache=True,
            cache_position=cache_position,
        )
        return self.head(outputs[0])


def decode_steps(count: int, encoder_states: torch.Tensor, seed: int, vocab: int):
    tokens = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
    return [(tokens[i : i + 1].view(1, 1), encoder_states, torch.tensor([i])) for i in range(count)]


def encoder_states(length: int, width: int, seed: int = 2) -> torch.Tensor:
    """A fixed random encoder output (the decoder is what keeps state)."""
    return torch.randn(1, length, width, generator=torch.Generator().manual_seed(seed))


def main(name: str, description: str, build_model, encoder_length: int, width: int) -> int:
    """Command line shared by whisper_decoder.py and t5_decoder.py."""
    from decoder_report import report

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quant", default="16a8w", choices=["16a8w", "8a8w", "16a4w", "16a16w"])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    states = encoder_states(encoder_length, width)
    calibration = decode_steps(32, states, 1, 256)
    report(name, build_model(), calibration, decode_steps(args.steps, states, 2, 256), args.quant)
    return 0
