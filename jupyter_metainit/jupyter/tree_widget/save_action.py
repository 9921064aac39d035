"""The widget's *Save…*: write the model, or the selected subtree, with
:func:`jupyter_metainit.save` on the worker thread (progress and Cancel as for Materialize).

Nothing in the model changes: deferred parts stay deferred, their values are computed one
tensor at a time as they are written. A cancelled or failed save leaves nothing at the path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jupyter_metainit.core import (
    format_bytes,
    parse_dtype,
    parse_path,
    tensor_values,
    unique_tensors,
)
from jupyter_metainit.jupyter.tree_widget.actions import ActionCancelled
from jupyter_metainit.jupyter.tree_widget.wording import modules_in_words
from jupyter_metainit.saving import save
from jupyter_metainit.saving.staging import is_dcp_file

if TYPE_CHECKING:
    from jupyter_metainit.jupyter.tree_widget.host import WidgetHost

__all__ = ["FORMATS", "prepare_save", "written_in_words"]

FORMATS = ("safetensors", "dcp")


def prepare_save(widget: WidgetHost, content: dict) -> tuple[str, Callable[[], str]]:
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
    destination = os.path.abspath(parse_path(path, typed=True))
    _confirm_replacing(widget, destination, fmt)
    what = modules_in_words(names or [""], widget.var_name)
    dtype = parse_dtype(widget.dtype or None)

    def job() -> str:
        obj = widget.module.get_submodule(names[0]) if names else widget.module
        widget.phase = f"writing {fmt}"

        def progress(done: int, total: int) -> None:
            widget._progress(done, total, f"writing {fmt} to {destination}")

        before = _file_ids(destination)
        try:
            save(obj, destination, format=fmt, dtype=dtype, progress=progress)
        except ActionCancelled:
            raise ActionCancelled(f"nothing was written to {destination}.") from None
        except OSError as exc:  # the file system's answer, about the path the user typed
            if exc.filename is None:  # save said it already, in the user's words
                raise OSError(exc.strerror or str(exc)) from None
            raise OSError(
                f"cannot write to {destination} ({exc.strerror or exc}); choose a directory "
                "you can write to. Nothing was saved"
            ) from None
        wrote = written_in_words(destination, before)
        return f"Saved {what} to {destination} ({fmt}) in {{took}}: {wrote}." + _fast_note(obj)

    return "save", job


def _fast_note(obj: Any) -> str:
    """Said, not only tagged: parts materialized with RNG fast are saved as they are, and their
    values are not those eager code gives."""
    fast = sum(tensor_values(t) == "fast" for t in unique_tensors(obj))
    if not fast:
        return ""
    return (
        f" {fast} of its tensors hold RNG fast values (not eager's), saved as they are; "
        "materialize them with RNG exact first for eager's values."
    )


def _confirm_replacing(widget: WidgetHost, destination: str, fmt: str) -> None:
    """A save that would replace a checkpoint already there asks first: refused once with what
    is there; the same save asked again goes ahead (a page click cannot be undone)."""
    there = _checkpoint_files(destination, fmt)
    asked = (destination, fmt)
    if not there or getattr(widget, "_replace_confirmed", None) == asked:
        widget._replace_confirmed = None
        return
    widget._replace_confirmed = asked
    shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
    raise ValueError(
        f"{destination} already holds a checkpoint ({shown}). Click Save again to replace "
        "it (your other files there stay), or choose another directory; nothing was saved."
    )


def _checkpoint_files(directory: str, fmt: str) -> list[str]:
    """The files of a checkpoint of this format in ``directory``: what a save there replaces
    (a checkpoint of the other format stays beside it)."""
    if not os.path.isdir(directory):
        return []
    if fmt == "dcp":
        return sorted(filter(is_dcp_file, os.listdir(directory)))
    return sorted(
        name
        for name in os.listdir(directory)
        if name in ("config.json", "generation_config.json")
        or name.endswith((".safetensors", ".safetensors.index.json"))
    )


def _file_ids(directory: str) -> dict[str, int]:
    """Each file's inode: a save puts new files in place (a new inode for each)."""
    if not os.path.isdir(directory):
        return {}
    return {e.name: e.inode() for e in os.scandir(directory) if e.is_file()}


def written_in_words(directory: str, before: dict[str, int] | None = None) -> str:
    """``model.safetensors (1.2 MiB), config.json (700 B)``: the files a save wrote (those new
    since ``before``, from :func:`_file_ids`: not the other files the directory holds)."""
    before = before or {}
    files = [
        (e.name, e.stat().st_size)
        for e in sorted(os.scandir(directory), key=lambda e: e.name)
        if e.is_file() and before.get(e.name) != e.inode()
    ]
    total = format_bytes(sum(size for _, size in files))
    shown = ", ".join(f"{name} ({format_bytes(size)})" for name, size in files[:4])
    more = f" and {len(files) - 4} more" if len(files) > 4 else ""
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {total}: {shown}{more}"
