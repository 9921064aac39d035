"""The code base passes ruff's lint rules and formatting (configured in pyproject.toml)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check_passes():
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_is_applied():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr
