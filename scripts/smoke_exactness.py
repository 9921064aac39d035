"""Smoke check of exactness in whatever environment runs it: deferred construction, then
``materialize``, gives the tensors eager construction gives with the same seed (``torch.equal``).

Run by ``scripts/version_ends.py`` in each end's environment (the newest and the lowest admitted
torch, transformers and accelerate) beside the core tests, as a user would first try the
package. Prints one line, ``smoke: exact (N tensors: ...)``, and exits 0; on a difference it
names the tensors and exits 1.

    python scripts/smoke_exactness.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from jupyter_metainit import materialize, meta_init


def plain_model() -> nn.Module:
    """Modules whose initialisations draw from the generator in different ways (uniform,
    normal, kaiming, orthogonal through a QR decomposition, fills)."""
    model = nn.Sequential(
        nn.Embedding(50, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 32),
        nn.GELU(),
        nn.Linear(32, 16),
        nn.Conv1d(16, 8, 3),
        nn.LSTM(8, 8),
    )
    nn.init.orthogonal_(model[2].weight)
    nn.init.trunc_normal_(model[4].weight, std=0.02)
    return model


def tiny_llama() -> nn.Module:
    """A two-layer Llama from transformers' own ``from_config`` (its ``_init_weights``)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def differences(build: Callable[[], nn.Module]) -> tuple[int, list[str]]:
    """How many tensors ``build`` makes, and the names of those deferred construction plus
    ``materialize`` gets wrong against eager construction with the same seed."""
    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with meta_init():
        deferred = build()
    materialize(deferred)
    want = eager.state_dict()
    got = deferred.state_dict()
    wrong = [k for k in want if k not in got or not torch.equal(want[k], got[k])]
    return len(want), wrong


def main() -> int:
    """Check each model; print the one-line verdict; 0 when every tensor is equal."""
    counts = []
    wrong = []
    for name, build in [("plain", plain_model), ("llama", tiny_llama)]:
        n, bad = differences(build)
        counts.append(f"{n} {name}")
        wrong += [f"{name}.{k}" for k in bad]
    if wrong:
        print(f"smoke: differs from eager: {', '.join(wrong)}")
        return 1
    print(f"smoke: exact ({', '.join(counts)} tensors, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
