"""What the widget says: the modules an action concerns, why it failed, what it did, in words.

Every sentence the widget shows about an action is made here, so that the wording stays the
same whichever path (button, Python call, queued click) led to it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jupyter_metainit.core import format_bytes, format_duration, is_out_of_memory

__all__ = [
    "MODEL_GONE",
    "SAVED_ADVICE",
    "code_path",
    "estimate_failure_in_words",
    "failure_in_words",
    "materialized_in_words",
    "model_changed_in_words",
    "modules_in_words",
    "no_room_in_words",
]

MODEL_GONE = (
    "The model this widget showed is gone: no name in the kernel refers to it any more, so it "
    "was freed. Nothing was done. Show the model you have now with "
    "jupyter_metainit.explore(model)."
)


def model_changed_in_words(name: str, var_name: str = "model") -> str:
    """Why a tree no longer shows its model: a module was added, removed or replaced."""
    where = f"`{code_path(var_name, name)}`" if name else "its root"
    return (
        f"The model changed since this tree was drawn ({where} was added, removed or replaced), "
        "so the tree no longer shows it. Nothing was done. Show it again with "
        "jupyter_metainit.explore(model)."
    )


SAVED_ADVICE = (
    "This is a saved copy: the live tree needs the kernel that made it. Run the cell again "
    "(or jupyter_metainit.explore(model) on a model you have) to get a live tree."
)


def code_path(var_name: str, qname: str) -> str:
    """``model.layers.5`` of ``model`` as Python the magics take: ``model.model.layers[5]``."""
    path = var_name
    for part in qname.split(".") if qname else []:
        if part.isdigit():
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}"
        else:
            return f"{var_name}.get_submodule({qname!r})"
    return path


def modules_in_words(names: Sequence[str], var_name: str = "model") -> str:
    """``model.layers[0], model.norm and 2 more``: the modules an action concerns, for a
    sentence, each as the Python that reaches it (as the magics take it and *Copy* gives it);
    the root as ``model (the whole model)``."""
    shown = ", ".join(_module_in_words(n, var_name) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _module_in_words(name: str, var_name: str) -> str:
    return code_path(var_name, name) if name else f"{var_name} (the whole model)"


def no_room_in_words(device: str, need: int, free: int) -> str:
    """Why a selection cannot be materialized on ``device``: the words of the page's unavailable
    button and of the kernel's refusal, whichever side asked."""
    return (
        f"Does not fit: the selection needs {format_bytes(need)}, {format_bytes(free)} free on "
        f"{device}. Select less, pick a smaller dtype or free something first."
    )


def failure_in_words(exc: Exception, action: str, device: str, what: str, nbytes: int) -> str:
    """Why an action failed, in plain words (``what``: the modules, in words)."""
    name = type(exc).__name__
    if is_out_of_memory(exc):
        return (
            f"Out of memory: {device or 'the device'} has no room for the "
            f"{format_bytes(nbytes)} that {what} needs. Try a smaller selection, another "
            "device or a smaller dtype."
        )
    if name == "UnsupportedOperatorError":
        return f"An operation used to build {what} cannot be replayed: {exc}."
    if name == "DeferredDataError":
        return f"{what} needs real data that is not available: {exc}."
    verb = "Materializing" if action == "materialize" else "Freeing"
    return f"{verb} {what} failed ({name}): {exc}."


# A kernel that takes bfloat16 only: torch._grouped_mm's meta kernel (MoE experts), and the
# "expected scalar type BFloat16" of others.
_BF16_ONLY = re.compile(
    r"(?:Expected inputs of BF16 type|expected (?:scalar type|dtype) BFloat16)[^;)\n]*",
    re.IGNORECASE,
)


def estimate_failure_in_words(text: str, model_dtype: str) -> str | None:
    """Why a plan's estimate failed, in words, when the cause is known (else None): a kernel
    of the model that takes only bfloat16, while the dry run runs the forward in the model's
    own dtype (``model_dtype``, in words) whatever the plan's precision."""
    found = _BF16_ONLY.search(text)
    if found is None or model_dtype == "bfloat16":  # then the cause is elsewhere (the inputs)
        return None
    detail = found.group().rstrip(". ")
    return (
        "the dry run of the workload reached a kernel of this model that takes only bfloat16 "
        f"inputs (MoE experts' grouped matmul is one), and the model is {model_dtype}: the "
        "dry run runs the forward in the model's own dtype, whatever the plan's Precision. "
        "Build the model in bfloat16 (%%meta_init --dtype bfloat16) and plan again "
        f"(the kernel said: {detail})"
    )


def materialized_in_words(
    what: str, device: str, dtype: str, rng: str, took: float, regenerated: int, kept_fast: str
) -> str:
    """The status after materializing ``what`` (the modules, in words)."""
    return (
        f"Materialized {what} on {device or 'its recorded device'}"
        + (f" as {dtype}" if dtype else "")
        + f" in {format_duration(took)}"
        # said, not only tagged: these values are deterministic but not eager's
        + (" with RNG fast (its values are not those eager code gives)." if rng == "fast" else ".")
        + (
            f" Re-generated {regenerated} tensor(s) that held fast-RNG values with "
            "exact (eager) values."
            if regenerated
            else ""
        )
        + kept_fast
    )
