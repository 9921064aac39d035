"""The widget's *Save…*: write the model, or the selected subtree, with
:func:`jupyter_metainit.save` on the worker thread (progress and Cancel as for Materialize).

Nothing in the model changes: deferred parts stay deferred, their values are computed one
tensor at a time as they are written. A cancelled or failed save leaves nothing at the path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jupyter_metainit.core import format_bytes, parse_dtype
from jupyter_metainit.jupyter.tree_widget.actions import ActionCancelled
from jupyter_metainit.jupyter.tree_widget.wording import code_path
from jupyter_metainit.save import save

__all__ = ["FORMATS", "prepare_save", "written_in_words"]

FORMATS = ("safetensors", "dcp")


def prepare_save(widget: Any, content: dict) -> tuple[str, Callable[[], str]]:
    """Check a save message (a mistake raises ValueError, said as a notice); the busy label
    and the job. ``{"action": "save", "path": "ckpt", "format": "safetensors", "names": [...]}``:
    no name saves the whole model, one name that subtree."""
    path = content.get("path")
    if not isinstance(path, str) or not path.strip():
        raise ValueError(
            "Type the directory to save to first (e.g. checkpoints/seed); nothing was saved."
        )
    fmt = content.get("format", "safetensors")
    if fmt not in FORMATS:
        raise ValueError(f"Refused: the format is safetensors or dcp, not {fmt!r}.")
    names = content.get("names") or []
    if names:
        names = widget._check_names(names)
    if len(names) > 1:
        raise ValueError(
            "Select one subtree to save it alone, or none to save the whole model; "
            "nothing was saved."
        )
    destination = os.path.abspath(os.path.expanduser(path.strip()))
    what = code_path(widget.var_name, names[0]) if names else f"{widget.var_name} (whole model)"
    dtype = parse_dtype(widget.dtype or None)

    def job() -> str:
        obj = widget.module.get_submodule(names[0]) if names else widget.module
        widget.phase = f"writing {fmt}"

        def progress(done: int, total: int) -> None:
            widget._progress(done, total, f"writing {fmt} to {destination}")

        try:
            save(obj, destination, format=fmt, dtype=dtype, progress=progress)
        except ActionCancelled:
            raise ActionCancelled(f"nothing was written to {destination}.") from None
        return (
            f"Saved {what} to {destination} ({fmt}) in {{took}}: {written_in_words(destination)}."
        )

    return "save", job


def written_in_words(directory: str) -> str:
    """``model.safetensors (1.2 MiB), config.json (700 B)``: the files a save wrote."""
    files = []
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(root, name)
            files.append((os.path.relpath(path, directory), os.path.getsize(path)))
    total = format_bytes(sum(size for _, size in files))
    shown = ", ".join(f"{name} ({format_bytes(size)})" for name, size in files[:4])
    more = f" and {len(files) - 4} more" if len(files) > 4 else ""
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {total}: {shown}{more}"
