"""The widget's *Compare with…*: :func:`jupyter_metainit.compare` of the ticked subtrees (or the
whole model) against a checkpoint path or a model / state dict named in the kernel's namespace,
on the worker thread with progress and Cancel. Neither side changes.

The result is the kernel-owned ``comparison`` trait: per tensor its status and measures, per
tree node the worst kind of difference under it, which the page shows as row colours.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from jupyter_metainit.core import parse_path
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.inspection.comparison import compare_layouts
from jupyter_metainit.inspection.sources import open_source
from jupyter_metainit.jupyter.tree_widget.stale_results import remember_measured
from jupyter_metainit.jupyter.tree_widget.wording import modules_in_words

if TYPE_CHECKING:
    from jupyter_metainit.jupyter.tree_widget.host import WidgetHost

__all__ = ["KINDS", "TINY_REL_L2", "kind_of", "prepare_compare"]

#: What a row's colour says, from best to worst (a module shows its worst tensor's).
KINDS = ("equal", "tiny", "large", "missing", "shape")
#: A difference up to this rel_l2 is *tiny* (a dtype round trip, a float reordering).
TINY_REL_L2 = 1e-3
_MAX_TEXT = 4096


def kind_of(status: str, rel_l2: float) -> str:
    """A compare row's colour: equal, tiny (rel_l2 <= TINY_REL_L2), large, missing or shape."""
    if status == "equal":
        return "equal"
    if status.startswith("only in"):
        return "missing"
    if status == "shape differs":
        return "shape"
    return "tiny" if rel_l2 <= TINY_REL_L2 else "large"


def resolve_other(text: Any, namespace: dict | None) -> tuple[Any, str]:
    """The other side as typed: a variable of the kernel holding a module or a state dict, or
    a checkpoint path (``~`` expanded, as Save… does). A path is opened here, its headers read,
    so a path that holds no checkpoint is refused before anything runs.

    Args:
        text: what the page sent: a variable name or a path.
        namespace: the kernel's user namespace (None outside IPython: paths only).

    Returns:
        The other side (the module, the dict or the absolute path) and how to name it.

    Raises:
        ValueError: a one-line message saying what to type; nothing was compared.
    """
    if not isinstance(text, str) or not text.strip() or len(text) > _MAX_TEXT:
        raise ValueError(
            "Type a checkpoint path or the name of a model or state dict in the notebook; "
            "nothing was compared."
        )
    text = text.strip()
    if text.isidentifier() and namespace is not None and text in namespace:
        obj = namespace[text]
        if isinstance(obj, torch.nn.Module) or (
            isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())
        ):
            return obj, text
        raise ValueError(
            f"Refused: {text} is a {type(obj).__name__}, not a model or a state dict; "
            "nothing was compared."
        )
    path = os.path.abspath(parse_path(text, typed=True))
    if not os.path.exists(path):
        named = (
            f"no model or state dict named {text} in the notebook and "
            if (text.isidentifier())
            else ""
        )
        raise ValueError(
            f"{text!r}: {named}no such file or directory"
            f"{'' if path == text else f' ({path})'}; type a checkpoint path or "
            "a variable holding a model or a state dict. Nothing was compared."
        )
    _check_checkpoint(path)
    return path, path


def _check_checkpoint(path: str) -> None:
    """Refuse a path that holds no checkpoint compare can read (its headers are read, not its
    tensors: a sharded checkpoint opens in milliseconds)."""
    why = ""
    try:
        source = open_source(path, "compare")
    except ArgumentError:  # no checkpoint file there: said below
        source = None
    except Exception as exc:  # a file that is not what its name says (safetensors' own error)
        first = str(exc).splitlines()[0] if str(exc) else ""
        source, why = None, f" ({type(exc).__name__}: {first[:200]})"
    if source is None or not source.entries:
        raise ValueError(
            f"{path} holds no checkpoint compare can read{why}: give a .safetensors file, a "
            "sharded checkpoint's index or its directory, or a torch.distributed.checkpoint "
            "directory. Nothing was compared."
        )


def _namespace() -> dict | None:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency of the widget
        return None
    shell = get_ipython()
    return None if shell is None else shell.user_ns


def _clear_comparison(widget: WidgetHost) -> None:
    """A new Compare takes the earlier one's colours off at once, as a cell run again clears
    its output: a Compare that is refused or fails then leaves no colours that look current."""
    if widget.comparison.get("modules") is not None:
        widget._measured.pop("comparison", None)
        widget.comparison = {"id": int(widget.comparison.get("id", 0)) + 1}


def prepare_compare(widget: WidgetHost, content: dict) -> tuple[str, Callable[[], str]]:
    """Check a compare message; the busy label and the job. ``{"action": "compare",
    "other": "finetuned/" | "base_model", "names": [...]}``."""
    if not widget.busy:  # busy: this Compare is refused, the running job's result stands
        _clear_comparison(widget)
    names = content.get("names") or []
    if names:
        names = widget._check_names(names)
    other, said = resolve_other(content.get("other"), _namespace())
    what = modules_in_words(names or [""], widget.var_name)

    def job() -> str:
        scope = [n for n in names if n]
        b = other.state_dict() if isinstance(other, torch.nn.Module) else other

        def progress(done: int, total: int, phase: str = "") -> None:
            widget._progress(done, total, f"comparing with {said}")

        # against a path, the ticked subtrees are seen in the file's layout, each file tensor
        # coloured on the row of the model tensor it comes from
        table, layout = compare_layouts(widget.module, b, scope, progress, origins=True)
        next_id = int(widget.comparison.get("id", 0)) + 1
        widget.comparison = comparison_payload(widget, table, said, next_id, layout.origin)
        remember_measured(widget, "comparison", scope)
        counts = table["status"].value_counts()
        parts = ", ".join(f"{int(c):,} {s}" for s, c in counts.items())
        return f"Compared {what} with {said} in {{took}}: {parts}."

    return "compare", job


#: How a measure that is not finite travels (JSON has no inf or NaN); the page shows the word.
NOT_FINITE = {math.inf: "inf", -math.inf: "-inf"}


def _number(value: Any) -> float | str:
    """A measure as JSON carries it: the number, or ``"inf"``, ``"-inf"`` or ``"nan"``."""
    value = float(value)
    if math.isfinite(value):
        return value
    return NOT_FINITE.get(value, "nan")


def _larger(value: float, than: float | None) -> bool:
    """Whether rel_l2 ``value`` is the new largest: a NaN (not finite, its size unknown) and inf
    rank above every number, so a parent's "up to" never leaves them out."""
    if than is None:
        return True
    rank = (math.isnan(value), value if not math.isnan(value) else 0.0)
    return rank > (math.isnan(than), than if not math.isnan(than) else 0.0)


def comparison_payload(
    widget: WidgetHost, table: Any, other: str, id_: int, origin: dict[str, str] | None = None
) -> dict:
    """The ``comparison`` trait: per tensor ``[name, node, kind, status, rel_l2, max_abs_diff,
    cosine]``, per node ``[node, worst kind, tensors that differ, largest rel_l2]``; a measure
    that is not finite is the string ``"inf"``, ``"-inf"`` or ``"nan"`` (a NaN ranks as the
    largest rel_l2), a missing or reshaped tensor's are None. A file's
    tensor is on the row of the model tensor it comes from (``origin``: file name -> model
    name, where a fused weight is written split)."""
    index = widget._tree.index
    tensors: list[list] = []
    nodes: dict[int, tuple[str, int, float | None]] = {}  # the largest rel_l2 as a float
    origin = origin or {}
    for name, row in table.iterrows():
        kind = kind_of(row["status"], float(row["rel_l2"]))
        owner = origin.get(name, name).rpartition(".")[0]
        # a missing or reshaped tensor has no measures (NaN in the table): none, not "nan"
        measured = kind in ("equal", "tiny", "large")
        rel = float(row["rel_l2"]) if measured else None
        tensors.append(
            [name, index.get(owner, -1), kind, row["status"]]
            + [_number(row[m]) if measured else None for m in ("rel_l2", "max_abs_diff", "cosine")]
        )
        parts = owner.split(".") if owner else []
        for k in range(len(parts) + 1):
            node = index.get(".".join(parts[:k]))
            if node is None:
                continue
            worst, differ, largest = nodes.get(node, ("equal", 0, None))
            if KINDS.index(kind) > KINDS.index(worst):
                worst = kind
            if kind != "equal":
                differ += 1
            if rel is not None and _larger(rel, largest):
                largest = rel
            nodes[node] = (worst, differ, largest)
    return {
        "id": id_,
        "other": other,
        "kinds": list(KINDS),
        "tiny": TINY_REL_L2,
        "tensors": tensors,
        "modules": [
            [node, worst, differ, None if largest is None else _number(largest)]
            for node, (worst, differ, largest) in nodes.items()
        ],
    }
