"""Sizes, counts and durations in words people read: the one formatter every layer uses.

Errors, summaries, magics, memory tables and the widget all print bytes and parameter counts
with these functions; the widget's TypeScript twin (``labextension/src/format.ts``) is tested
against the same cases (``labextension/test/format_cases.json``). Durations are printed by Python
only (the magics and the widget's status line).
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_count", "format_duration"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept (``1.50``, ``15.0``, ``150``)."""
    if abs(value) >= 99.95:
        return f"{value:.0f}"
    if abs(value) >= 9.995:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_bytes(n: float) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.50 KiB"``, ``1_028_000`` -> ``"0.98 MiB"``.

    Binary units; a value moves to the next unit from 1000 on, so that no size reads as four
    digits ("1003.9 KiB").
    """
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 999.5 or unit == _BYTE_UNITS[-1]:
            return f"{value:.0f} B" if unit == "B" else f"{_three_digits(value)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """``950`` -> ``"950"``, ``1_234_567`` -> ``"1.23 M"``, ``70_553_706_496`` -> ``"70.6 B"``."""
    for unit, scale in _COUNT_UNITS:
        if abs(n) >= scale * 0.9995:
            return f"{_three_digits(n / scale)} {unit}"
    return f"{int(n)}"


def format_duration(seconds: float) -> str:
    """``0.0004`` -> ``"<1 ms"``, ``0.0423`` -> ``"42 ms"``, ``3.25`` -> ``"3.2 s"``: a quick
    materialization does not read as "0.0 s", as if nothing had happened."""
    if seconds < 0.0005:
        return "<1 ms"
    if seconds < 0.9995:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s"
