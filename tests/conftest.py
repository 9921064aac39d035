from __future__ import annotations

import gc
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    gc.collect()
