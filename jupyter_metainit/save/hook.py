"""The hook on transformers' ``PreTrainedModel.save_pretrained``: a deferred model is saved by
``save.pretrained``.

The method is wrapped once (``functools.wraps``: same name, signature and docstring); the wrapper
diverts only a model, or a ``state_dict=``, that holds deferred tensors, and adds nothing to any
instance. It is installed when this module is imported (``import jupyter_metainit`` imports it)
if transformers' ``modeling_utils`` is already imported, else right after it is (a one-shot
import hook): importing ``jupyter_metainit`` never imports transformers, in either order.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

from jupyter_metainit.save.pretrained import holds_deferred, save_deferred

__all__ = ["install_save_pretrained"]

_TARGET = "transformers.modeling_utils"
_MARK = "__jupyter_metainit_save_pretrained__"


def install_save_pretrained() -> None:
    """Wrap ``PreTrainedModel.save_pretrained`` now if transformers is imported, else as soon as
    its ``modeling_utils`` is. Idempotent."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


def _wrap(modeling_utils: Any) -> None:
    cls = getattr(modeling_utils, "PreTrainedModel", None)
    original = None if cls is None else cls.__dict__.get("save_pretrained")
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not holds_deferred(self, args, kwargs):
            return original(self, *args, **kwargs)
        return save_deferred(self, original, args, kwargs)

    setattr(save_pretrained, _MARK, True)
    cls.save_pretrained = save_pretrained


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.modeling_utils`` is imported, it hands back the
    real spec with a loader that runs the module and then installs the wrapper."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ThenInstall(spec.loader, self)
        return spec


class _ThenInstall(importlib.abc.Loader):
    """The real loader, then ``install_save_pretrained``; the module keeps the real loader."""

    def __init__(self, loader: Any, finder: _InstallAfterImport) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _wrap(module)
