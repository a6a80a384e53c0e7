"""A tiny random-init Qwen2 causal LM with transformers' StaticCache on the HTP.

Builds the model from a config (no weights are downloaded), wraps it with
transformers' ExecuTorch wrapper (KV caches registered as buffers, updated in place
with index_copy_), quantizes it with qnn_mutbuf (16a8w by default), lowers it for
SM8650 with the caches inside the delegate and runs 32 decode steps on the host
simulator, feeding token ids and cache positions. Prints, per step, logits SQNR
against fp32 and fake-quant and top-1 agreement.

    python scripts/qwen2_static_cache.py [--quant 8a8w] [--steps 32] [--pte out.pte]
"""

from __future__ import annotations

import argparse
import sys

import torch

CACHE_LENGTH = 64


class DecodeStep(torch.nn.Module):
    """(input_ids, cache_position) -> logits, state in the wrapper's cache buffers."""

    def __init__(self, wrapper: torch.nn.Module) -> None:
        super().__init__()
        self.wrapper = wrapper

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.wrapper(input_ids=input_ids, cache_position=cache_position)


def build_model(seed: int = 0, initializer_range: float = 0.02) -> torch.nn.Module:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": CACHE_LENGTH},
    )
    wrapper = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=CACHE_LENGTH)
    return DecodeStep(wrapper).eval()


def decode_steps(
    count: int, seed: int = 1, vocab: int = 256
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and cache positions 0..count-1 (a random "prompt", teacher-forced)."""
    tokens = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
    return [(tokens[i : i + 1].view(1, 1), torch.tensor([i])) for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="16a8w", choices=["16a8w", "8a8w", "16a4w", "16a16w"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--calibration-steps", type=int, default=32)
    parser.add_argument("--pte", help="also write the lowered program here")
    args = parser.parse_args()

    from decoder_report import report

    program = report(
        "Qwen2 tiny",
        build_model(),
        decode_steps(args.calibration_steps, seed=1),
        decode_steps(args.steps, seed=2),
        args.quant,
    )
    if args.pte:
        from qnn_mutbuf.artifacts import write_atomically

        write_atomically(args.pte, program.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
