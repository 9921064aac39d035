"""The devices the widget offers, and whether a selection fits each one's free memory.

Discovered once per widget (the visible CUDA devices, or why there are none); the fit is
measured as :func:`~jupyter_metainit.estimates.fits` measures it.
"""

from __future__ import annotations

import torch

from jupyter_metainit.core import format_bytes
from jupyter_metainit.estimates.fit import device_budget
from jupyter_metainit.jupyter.tree_widget.wording import no_room_in_words

__all__ = ["fit_per_device", "visible_cuda_devices"]


def visible_cuda_devices() -> tuple[list[dict[str, str]], str]:
    """The visible CUDA devices as ``[{"name", "label"}]``, and why there are none if so."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return [], "This PyTorch build has no CUDA support, so there is no GPU to materialize to."
    if not torch.cuda.is_available():
        return [], "No CUDA device is visible to this kernel (torch.cuda.is_available() is False)."
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {"name": f"cuda:{i}", "label": f"{props.name}, {format_bytes(props.total_memory)}"}
        )
    return devices, ""


def fit_per_device(summary: dict, devices: list[dict[str, str]]) -> dict[str, dict]:
    """Per device: the memory materializing the selection there takes (in the chosen dtype,
    minus what is on that device already), the device's free memory (as ``fits`` measures
    it), whether the one fits in the other and, when not, why in words (``why``: what the page
    and the kernel both say)."""
    out = {}
    for device in ["cpu", *(d["name"] for d in devices)]:
        try:
            free = device_budget(device)
        except ValueError:  # cannot measure: say nothing rather than guess
            continue
        need = sum(b for state, b in summary["states_as"].items() if state != device)
        out[device] = {"need": need, "free": free, "fits": need <= free}
        if need > free:
            out[device]["why"] = no_room_in_words(device, need, free)
    return out
