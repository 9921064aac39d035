"""The one byte/count formatter, checked against the cases its TypeScript twin also passes."""

from __future__ import annotations

import json
import pathlib

import pytest

from jupyter_metainit.core.runtime.format import format_bytes, format_count, format_duration

_CASES = json.loads(
    (pathlib.Path(__file__).parents[1] / "labextension" / "test" / "format_cases.json").read_text()
)


@pytest.mark.parametrize(("n", "text"), _CASES["bytes"])
def test_format_bytes_matches_the_shared_cases(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(("n", "text"), _CASES["counts"])
def test_format_count_matches_the_shared_cases(n, text):
    assert format_count(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0001, "<1 ms"), (0.0423, "42 ms"), (0.9994, "999 ms"), (0.9996, "1.0 s"), (3.25, "3.2 s")],
)
def test_format_duration_reads_as_milliseconds_below_a_second(seconds, text):
    assert format_duration(seconds) == text
