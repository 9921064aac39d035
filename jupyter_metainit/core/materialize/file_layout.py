"""A transformers model's tensors in its checkpoint files' layout (what ``save_pretrained``
writes), the one rule that ``save`` and ``compare`` share.

transformers >= 5 keeps some weights converted in memory: it renames some (GPT-NeoX's
``lm_head`` is ``embed_out`` in the file) and fuses others (a mixture of experts' experts in one
tensor), and ``save_pretrained`` writes them back in the file's layout with
``revert_weight_conversion``. transformers is imported here only when this runs.
"""

from __future__ import annotations

import torch

__all__ = ["in_file_layout"]


def in_file_layout(
    model: torch.nn.Module, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """``state`` (``model``'s tensors by name) as ``model.save_pretrained`` lays them out in
    its files, or ``None`` where transformers converts nothing in memory (transformers 4, or
    none installed).

    On deferred tensors the conversion's views and splits are recorded, not computed: each part
    is computed when it is read. It runs without autograd (the result is read, never
    differentiated); ``state`` itself is left as it is.

    Args:
        model: a transformers model (the caller decides what counts as one).
        state: name -> tensor, e.g. ``model.state_dict()``.

    Returns:
        A new dict, file name -> tensor (a renamed weight is the same tensor object), or
        ``None`` without transformers >= 5.

    Examples:
        >>> import torch
        >>> from jupyter_metainit.core import in_file_layout
        >>> model = torch.nn.Linear(2, 2)
        >>> converted = in_file_layout(model, dict(model.state_dict()))
        >>> converted is None or sorted(converted)  # nothing to convert in a plain module
        ['bias', 'weight']
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4, or none: nothing is converted in memory
        return None
    with torch.no_grad():
        return dict(revert_weight_conversion(model, dict(state)))
