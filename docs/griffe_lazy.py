"""Griffe extension of the documentation site: the package's public names as users import them.

- ``jupyter_metainit`` loads its estimates and Jupyter names on first use through a module
  ``__getattr__`` over its ``_LAZY`` table, which static analysis cannot follow. Each of them is
  added to the package as an alias of its definition, so the API page documents
  ``jupyter_metainit.memory_table`` under the name users import, not under a module path.
- The docstrings use Sphinx roles (``:func:`materialize```), which Markdown would show as
  literal text; they become inline code.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

# :func:`name`, :class:`~torch.nn.Module`, ... (the ~ shows only the last part in Sphinx).
_SPHINX_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class LazyPublicNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "jupyter_metainit":
            return
        _plain_roles(pkg)
        if "_LAZY" not in pkg.members:
            return
        lazy: dict[str, str] = ast.literal_eval(str(pkg.members["_LAZY"].value))
        for name, module in lazy.items():
            if name in pkg.members:
                continue
            target = f"{module}.{name}"
            # A name re-exported by a package that also has a submodule of that name
            # (estimates.dry_run): griffe finds the submodule, the function is inside it.
            found = pkg.modules_collection.get_member(target)
            if isinstance(found, griffe.Module) and name in found.members:
                target = f"{target}.{name}"
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))


def _plain_roles(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _plain_roles(member)
