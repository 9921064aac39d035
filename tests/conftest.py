from __future__ import annotations

import gc
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))


EXT = "jupyter_metainit"

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage():
    # Once per file, not per test: a full collection of this heap (transformers, op_db) takes
    # seconds. Tests that assert memory is freed collect themselves.
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _no_lock_left_behind():
    """A test that leaves the core's lock taken would make every later test wait forever."""
    yield
    from jupyter_metainit.core.runtime import lock as _busy

    held = list(_busy._activity)
    if held:
        _busy._activity.clear()
        pytest.fail(f"the test left the core's lock taken: {held}")


@pytest.fixture
def shell():
    """IPython's one ``InteractiveShell``, with the names a test's cells add removed afterwards
    (the shell outlives the test: a name left behind would leak into later tests' cells)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    # Plain tracebacks for the tests that read their text. The magic, not the trait: IPython 8
    # ignores ``shell.colors = "nocolor"`` (its traceback printers keep their colour scheme),
    # IPython 9 takes either; ``%colors NoColor`` works on both.
    shell.run_line_magic("colors", "NoColor")
    names = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - names:
        del shell.user_ns[name]
    shell.user_ns["Out"].clear()


@pytest.fixture
def ip(shell):
    """The shell with this package's extension loaded (``%load_ext``), unloaded afterwards.

    A test file that needs set-up cells overrides it: ``def ip(ip): ip.run_cell(...)``."""
    shell.run_cell(f"%load_ext {EXT}")
    yield shell
    shell.run_cell(f"%unload_ext {EXT}")
