"""``%stats`` and ``%compare``: look at a model's values from a notebook line.

Thin layers over :func:`jupyter_metainit.stats` and :func:`jupyter_metainit.compare`, registered
with the other magics by ``%load_ext jupyter_metainit``. An operand is a Python expression in
your namespace (a module, a state dict, a tensor, a path string) or, when it is not one, a
checkpoint path as typed (``%compare model ./finetuned``). Mistakes are one-line
``UsageError``s, as with the other magics.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from jupyter_metainit.core import parse_path
from jupyter_metainit.inspection import compare, stats
from jupyter_metainit.jupyter.magic_options import one_line_errors, split_expression

__all__ = ["ValueMagics", "unregister_value_magics"]


@magics_class
class ValueMagics(Magics):
    """``%stats`` and ``%compare``; registered by ``%load_ext jupyter_metainit``."""

    shell: InteractiveShell

    def _operand(self, magic: str, text: str) -> Any:
        """``text``'s value in the user namespace; a tensor as a one-entry dict; an existing
        path typed without quotes as that path."""
        try:
            value = self.shell.ev(text)
        except Exception as exc:  # the user's expression: their mistake, told in one line
            typed = parse_path(text, typed=True)  # ~ and $VARS, as %save reads its PATH
            if os.path.exists(typed):
                return typed
            if _looks_like_path(text):
                raise UsageError(
                    f"%{magic}: no such file or directory: {text!r} (an operand is a Python "
                    "expression in your namespace or a checkpoint path)"
                ) from None
            message = str(exc).splitlines()[0] if str(exc).strip() else ""
            kind = f"{message} ({type(exc).__name__})" if message else type(exc).__name__
            raise UsageError(f"%{magic}: cannot evaluate {text!r}: {kind}") from None
        if isinstance(value, torch.Tensor):
            return {text: value}
        if isinstance(value, (str, os.PathLike)):  # a path typed on the line, quoted
            return parse_path(value, typed=True)
        return value

    def _options(self, magic: str, line: str) -> tuple[str, Any]:
        """Split ``line`` into the operands' text and the parsed options."""
        method = getattr(self, magic)

        def takes_value(option: str) -> bool:
            action = method.parser._option_string_actions.get(option)
            return action is not None and action.nargs != 0

        text, options = split_expression(line, takes_value)
        args = parse_argstring(method, options)
        if args.expr:
            raise UsageError(f"%{magic}: unexpected argument(s) {' '.join(args.expr)!r}")
        return text, args

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR", help="Model, state dict, tensor or path.")
    @argument("--per", choices=("tensor", "module"), help="Rows per tensor (default) or module.")
    @argument("--depth", metavar="N", type=int, help="Module rows down to this depth (0 = root).")
    @argument("--bins", metavar="N", type=int, help="Add a histogram of N bins per tensor.")
    @line_magic
    def stats(self, line: str) -> Any:
        """Statistics of EXPR's values per tensor (or per module), exact, without materializing
        it: ``%stats model``, ``%stats model --per module --depth 2``, ``%stats ./checkpoint``.

        Returns the DataFrame of :func:`jupyter_metainit.stats` (``table = %stats model``);
        shows a progress bar while it reads. ``--depth`` implies ``--per module``.
        """
        __tracebackhide__ = True
        text, args = self._options("stats", line)
        if not text:
            raise UsageError("%stats: missing EXPR (e.g. %stats model, %stats ./checkpoint)")
        per = args.per or ("module" if args.depth is not None else "tensor")
        if args.depth is not None and per != "module":
            raise UsageError("%stats: --depth chooses module rows; use it with --per module")
        if args.bins is not None and per != "tensor":
            raise UsageError("%stats: --bins gives a histogram per tensor; drop --per module")
        obj = self._operand("stats", text)
        return one_line_errors(
            "stats",
            lambda: stats(obj, per=per, bins=args.bins, depth=args.depth, progress=True),
            reword=_as_options,
        )

    @magic_arguments()
    @argument("expr", nargs="*", metavar="A B", help="Two models, state dicts or paths.")
    @line_magic
    def compare(self, line: str) -> Any:
        """Compare A and B tensor by tensor (models, state dicts or checkpoint paths):
        ``%compare base tuned``, ``%compare model ./checkpoint``.

        Returns the DataFrame of :func:`jupyter_metainit.compare` (``table = %compare a b``).
        """
        __tracebackhide__ = True
        text, _ = self._options("compare", line)
        first, second = _two_operands(text)
        a, b = self._operand("compare", first), self._operand("compare", second)
        return one_line_errors("compare", lambda: compare(a, b, progress=True))


def _as_options(text: str) -> str:
    """The function's argument names in the magic's words."""
    for name in ("per", "depth", "bins"):
        text = text.replace(f"{name}= ", f"--{name} ").replace(f"{name}=", f"--{name} ")
    return text


# A checkpoint's file names, for an operand typed as a path that does not exist.
_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".distcp")


def _looks_like_path(text: str) -> bool:
    """An operand typed as a path rather than as Python: a checkpoint's file name
    (``model.safetensors`` is no Python a user means), or no Python at all with a slash or
    from ``~`` or ``.`` (``sd[k]/2`` is Python, ``./tuned`` is not)."""
    text = text.strip()
    if text.lower().endswith(_CHECKPOINT_SUFFIXES):
        return True
    path_like = os.sep in text or "/" in text or text.startswith(("~", "."))
    return path_like and not _is_python(text)


def _is_python(text: str) -> bool:
    try:
        compile(text, "<operand>", "eval")
    except SyntaxError:
        return False
    return True


def _two_operands(text: str) -> tuple[str, str]:
    """``"a b"`` -> ``("a", "b")``: split at the first space (outside brackets and quotes)
    after which both sides are Python expressions or paths as typed."""
    words = text.split()
    if len(words) < 2:
        raise UsageError(
            "%compare: needs two operands: %compare A B (each a model, a state dict or a "
            "checkpoint path)"
        )
    for i, char in enumerate(text):
        if char.isspace():
            left, right = text[:i].strip(), text[i:].strip()
            if left and right and _operand_text(left) and _operand_text(right):
                return left, right
    raise UsageError(
        f"%compare: cannot read {text!r} as two operands: %compare A B (quote a path that "
        "holds spaces)"
    )


def _operand_text(text: str) -> bool:
    """A Python expression, or a path as typed (no spaces)."""
    return _is_python(text) or not any(c.isspace() for c in text)


def unregister_value_magics(ipython: InteractiveShell) -> None:
    """Remove ``%stats`` and ``%compare`` again (``unload_ipython_extension`` calls it;
    ``load_ipython_extension`` registers :class:`ValueMagics` with the others)."""
    manager = ipython.magics_manager
    for name in ValueMagics.magics["line"]:
        owner = getattr(manager.magics["line"].get(name), "__self__", None)
        if owner is not None and type(owner).__name__ == ValueMagics.__name__:
            del manager.magics["line"][name]
    manager.registry.pop(ValueMagics.__name__, None)
