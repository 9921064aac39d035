"""Model configurations shared by the tests (no weights: built under meta_init or meta)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The shapes of Llama-3-70B, the size the issues' targets are stated for: one definition, shared
# with the benchmarks (benchmarks/_common.py reads the same file).
LLAMA_70B: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "benchmarks" / "llama_70b.json").read_text()
)

TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


def llama_config(base: dict[str, Any] = TINY_LLAMA, **overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` of ``base`` shapes with ``overrides``."""
    import transformers

    return transformers.LlamaConfig(**{**base, **overrides})


def llama70b_on_meta() -> Any:
    """The 70B-shaped ``LlamaForCausalLM`` on PyTorch's meta device (nothing recorded)."""
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(LLAMA_70B))
