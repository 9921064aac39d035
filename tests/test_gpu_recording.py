"""Recording for a GPU on a machine that may have none (``meta_init(device="cuda")``,
``device="cuda:1"`` in the code, ``.to("cuda")`` of a deferred model).

Some of torch's Python bindings (``Tensor.copy_``, indexing, ``nonzero``, ``float(t)``) set a
device guard on their tensor's device before dispatching; a CPU-only PyTorch has none for CUDA.
Without a GPU, eager construction on the CPU draws the same numbers as a CUDA recording
materialized on the CPU; with one, eager draws on the GPU (``test_cuda.py``), so the eager twin
is built where the recording's random ops draw.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init

_DRAWS_ON = "cuda" if torch.cuda.is_available() else "cpu"


def _eager(build, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(_DRAWS_ON):
        return build()


def _for_cuda(build, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with meta_init(device="cuda"):
        return build()


def _assert_equal_on_cpu(model: nn.Module, eager: nn.Module) -> None:
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == "cpu", name
        assert torch.equal(real, expected.cpu()), name


def test_copy_into_a_tensor_recorded_for_cuda_is_recorded():
    with meta_init(device="cuda"):
        t = torch.empty(4).copy_(torch.arange(4.0))
    assert t.device == torch.device("cuda", 0) and is_deferred(t)
    materialize(t, device="cpu")
    assert torch.equal(t, torch.arange(4.0))


class _GuardedBindings(nn.Module):
    """Every binding that sets a device guard first, on tensors that report ``device``."""

    def __init__(self) -> None:
        super().__init__()
        a, b = torch.randn(8), torch.randn(8)
        a.copy_(b * 2)
        a[0:2] = 1.5  # a Python scalar: a value tensor made from a's options
        a[[3, 4]] = b[:2]  # a list index, likewise
        a[a > 1] = 0.25
        self.register_buffer("a", a)
        self.register_buffer("picked", b[torch.tensor([1, 5])])
        self.register_buffer("contiguous", a.view(2, 4).t().contiguous())
        self.register_buffer("nonzero", torch.nonzero(b > 0))
        self.register_buffer("inverted", ~(b > 0))
        self.register_buffer("scalars", torch.tensor([float(a[1]), int(b.abs()[0] * 10)]))
        self.register_buffer("orthogonal", nn.init.orthogonal_(torch.empty(4, 4)))
        self.register_buffer("sparse", nn.init.sparse_(torch.empty(4, 4), 0.5))


def test_bindings_that_set_a_device_guard_record_for_cuda_exactly():
    eager = _eager(_GuardedBindings)
    model = _for_cuda(_GuardedBindings)
    assert {t.device for t in model.buffers()} == {torch.device("cuda", 0)}
    materialize(model, device="cpu")
    _assert_equal_on_cpu(model, eager)


def test_copy_between_tensors_made_for_cuda_1_in_the_code_is_recorded():
    with meta_init():
        t = torch.zeros(3, device="cuda:1").copy_(torch.ones(3, device="cuda:1"))
    assert t.device == torch.device("cuda", 1)
    materialize(t, device="cpu")
    assert torch.equal(t, torch.ones(3))


def _tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_rope_transformers_model_built_for_cuda_equals_eager_construction():
    # transformers copies every rotary embedding's inv_freq with ``init.copy_``
    eager = _eager(_tiny_llama)
    model = _for_cuda(_tiny_llama)
    assert {t.device for t in model.state_dict().values()} == {torch.device("cuda", 0)}
    assert {b.device for b in model.buffers()} == {torch.device("cuda", 0)}
    materialize(model, device="cpu")
    _assert_equal_on_cpu(model, eager)
    for (name, real), (_, expected) in zip(
        model.named_buffers(), eager.named_buffers(), strict=True
    ):
        assert torch.equal(real, expected.cpu()), name


def test_load_state_dict_into_a_deferred_model_moved_to_cuda():
    with meta_init():
        lin = nn.Linear(4, 3)
    lin.to("cuda")
    state = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    lin.load_state_dict(state)
    assert lin.weight.device == torch.device("cuda", 0) and is_deferred(lin)
    materialize(lin, device="cpu")
    assert torch.equal(lin.weight, state["weight"]) and torch.equal(lin.bias, state["bias"])
