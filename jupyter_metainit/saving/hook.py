"""The diversion of transformers' ``PreTrainedModel.save_pretrained``: a deferred model is saved
by ``saving.pretrained``.

The method is wrapped once (``functools.wraps``: same name, signature and docstring); the wrapper
diverts only a model, or a ``state_dict=``, that holds deferred tensors, and adds nothing to any
instance. Importing ``jupyter_metainit`` changes nothing in transformers and adds no import hook:
the package installs the wrapper when a thread enters or leaves a ``meta_init`` block while
transformers is imported (``core.at_meta_init_edges``), the only way a deferred transformers
model comes to exist. Why not transformers' own extension points: ``save_pretrained`` has none
that sees the model's tensors before it reads their bytes (``save_function`` gets a state dict
whose deferred tensors it would have to materialize).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from jupyter_metainit.saving.pretrained import holds_deferred, save_deferred

__all__ = ["install_save_pretrained"]

_TARGET = "transformers.modeling_utils"
_MARK = "__jupyter_metainit_save_pretrained__"


def install_save_pretrained() -> bool:
    """Wrap ``PreTrainedModel.save_pretrained`` if transformers is imported (idempotent).

    Returns:
        Whether the wrapper is in place now (False while transformers is not imported).
    """
    module = sys.modules.get(_TARGET)
    if module is None:
        return False
    cls = getattr(module, "PreTrainedModel", None)
    original = None if cls is None else cls.__dict__.get("save_pretrained")
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not holds_deferred(self, args, kwargs):
            return original(self, *args, **kwargs)
        return save_deferred(self, original, args, kwargs)

    setattr(save_pretrained, _MARK, True)
    cls.save_pretrained = save_pretrained
    return True
