"""Cells run on a real ``InteractiveShell`` the way a notebook runs them (the ``shell`` and
``ip`` fixtures in ``conftest.py`` give the shell)."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.utils.capture import CapturedIO, capture_output


def run(shell: Any, code: str) -> tuple[Any, CapturedIO]:
    """Run ``code`` as a notebook cell; return its ExecutionResult and captured output."""
    with capture_output() as out:
        result = shell.run_cell(code, store_history=True)
    return result, out


def ok(shell: Any, code: str) -> CapturedIO:
    """Run a cell that must succeed; return its captured output."""
    result, out = run(shell, code)
    assert result.success, out.stdout
    return out


def usage_error(shell: Any, code: str) -> str:
    """Run a cell that must fail with a one-line UsageError; return the message."""
    result, out = run(shell, code)
    error = result.error_in_exec
    assert isinstance(error, UsageError), (error, out.stdout)
    assert "\n" not in str(error)
    assert "Traceback" not in out.stdout
    return str(error)
