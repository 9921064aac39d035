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
            if name not in pkg.members:
                pkg.set_member(
                    name, griffe.Alias(name, _definition(pkg, f"{module}.{name}"), parent=pkg)
                )
        # Names imported eagerly can meet the same clash (``core.materialize`` is a package and
        # the function it defines).
        for name, member in list(pkg.members.items()):
            if member.is_alias and not name.startswith("_") and name not in lazy:
                target = _definition(pkg, member.target_path)
                if target != member.target_path:
                    pkg.set_member(name, griffe.Alias(name, target, parent=pkg))


def _definition(pkg: griffe.Module, target: str) -> str:
    """``target``, or the function or class inside it when it names a module that defines one of
    the same name: a package re-exporting ``dry_run`` or ``materialize`` also has a submodule of
    that name, and griffe finds the submodule (down as many levels as the name repeats)."""
    name = target.rpartition(".")[2]
    while True:
        try:
            found = pkg.modules_collection.get_member(target)
        except (KeyError, griffe.AliasResolutionError):
            return target
        if not (isinstance(found, griffe.Module) and name in found.members):
            return target
        target = f"{target}.{name}"


def _plain_roles(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _plain_roles(member)
