"""Griffe extension of the documentation site: the package's lazily imported public names.

``jupyter_metainit`` loads its estimates and Jupyter names on first use through a module
``__getattr__`` over its ``_LAZY`` table, which static analysis cannot follow. This adds each of
them to the package as an alias of its definition, so the API page can document
``jupyter_metainit.memory_table`` under the name users import, not under a module path.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


class LazyPublicNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "jupyter_metainit" or "_LAZY" not in pkg.members:
            return
        lazy: dict[str, str] = ast.literal_eval(str(pkg.members["_LAZY"].value))
        for name, module in lazy.items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=pkg))
