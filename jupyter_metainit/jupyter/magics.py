"""IPython magics: ``%%meta_init`` and ``%materialize`` / ``%dematerialize`` / ``%meta_table``.

Load them with ``%load_ext jupyter_metainit``. Each magic is a thin layer over the core API:
``%%meta_init`` runs its cell under :func:`meta_init` (with normal cell semantics) and then shows
every ``torch.nn.Module`` the cell bound to a new top-level name; the line magics evaluate an
expression in the user namespace and call :func:`materialize`, :func:`dematerialize` or
``memory_table`` on it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.core.runtime.format import format_bytes, format_count, format_duration
from jupyter_metainit.core.runtime.walk import unique_tensors
from jupyter_metainit.jupyter._cells import watch_cells
from jupyter_metainit.jupyter.cell_runner import (
    install_short_tracebacks,
    run_cell_body,
    uninstall_short_tracebacks,
)
from jupyter_metainit.jupyter.magic_options import (
    parse_depth,
    parse_device,
    parse_dtype,
    split_expression,
    strip_comment,
)

__all__ = ["MetaInitMagics", "load_ipython_extension", "unload_ipython_extension"]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Parameters and buffers of a module (shared ones once), or the tensor(s) themselves."""
    if isinstance(obj, nn.Module):
        return unique_tensors(obj)
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _tensors(item)]


def _state(t: torch.Tensor) -> str:
    try:
        from jupyter_metainit.core import tensor_state
    except ImportError:  # pragma: no cover - the core is always there in a real install
        return "deferred" if t.is_meta else str(t.device)
    return tensor_state(t)


def summary_line(name: str, obj: Any) -> str:
    """One line for people: ``model: LlamaForCausalLM, 70.55 B parameters, 131.4 GiB, deferred``.

    Lazy parameters (``nn.LazyLinear`` before its first forward) have no shape yet: they are
    counted apart, as ``3 lazy tensors``.
    """
    tensors = _tensors(obj)
    known = [t for t in tensors if not is_lazy(t)]
    lazy = len(tensors) - len(known)
    if isinstance(obj, nn.Module):
        params = sum(p.numel() for p in obj.parameters() if not is_lazy(p))
    else:
        params = sum(t.numel() for t in known)
    size = sum(t.numel() * t.element_size() for t in known)
    parts = [type(obj).__name__, f"{format_count(params)} parameters", format_bytes(size)]
    if lazy:
        parts.append(f"{lazy} lazy tensor{'s' if lazy > 1 else ''}")
    parts.extend(sorted({_state(t) for t in known}) or ([] if lazy else ["no tensors"]))
    return f"{name}: " + ", ".join(parts)


def _has_module_state(module: nn.Module) -> bool:
    state = getattr(module, "__dict__", {})
    return all(key in state for key in ("_parameters", "_buffers", "_modules"))


def not_set_up_part(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module (qualified name, ``""`` for ``module`` itself) whose ``__init__`` never
    ran ``nn.Module.__init__`` (no ``super().__init__()``): it has no parameter or submodule
    dicts, so every walk over the model fails. None when every part is set up."""
    stack: list[tuple[str, nn.Module]] = [("", module)]
    seen: set[int] = set()
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not _has_module_state(m):
            return name, m
        for child_name, child in m._modules.items():
            if child is not None:
                stack.append((f"{name}.{child_name}" if name else child_name, child))
    return None


def is_set_up(module: nn.Module) -> bool:
    return not_set_up_part(module) is None


def not_set_up_note(name: str, module: nn.Module, refusal: str) -> str:
    """``b: Bad, not shown: ...`` saying which part was never set up and how to fix it."""
    part_name, part = not_set_up_part(module) or ("", module)
    kind = type(part).__name__
    where = f" (its part {part_name})" if part_name else ""
    return (
        f"{name}: {type(module).__name__}, {refusal}{where}: {kind}.__init__ never called "
        f"nn.Module.__init__ (add super().__init__() at the start of {kind}.__init__)"
    )


def new_bindings(before: dict[str, Any], after: dict[str, Any]) -> dict[str, nn.Module]:
    """Top-level ``nn.Module``s a cell bound or rebound (``before`` holds the objects)."""
    return {
        name: obj
        for name, obj in after.items()
        if not name.startswith("_")
        and isinstance(obj, nn.Module)
        and not (name in before and before[name] is obj)
    }


def new_modules(before: dict[str, Any], after: dict[str, Any]) -> dict[str, nn.Module]:
    """Top-level ``nn.Module``s bound or rebound by a cell, minus submodules of another new one.

    ``before`` holds the objects themselves (not their ids) so an id cannot be reused in between.
    Modules that were never set up (see :func:`is_set_up`) are left out.
    """
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, obj in new_bindings(before, after).items():
        if not is_set_up(obj):
            continue
        if id(obj) not in seen:
            seen.add(id(obj))
            found[name] = obj
    inner: set[int] = set()
    for module in found.values():
        inner.update(id(sub) for sub in module.modules() if sub is not module)
    return {name: m for name, m in found.items() if id(m) not in inner}


def _memory_table(module: nn.Module, depth: int | None, dtype: str | None) -> Any:
    """``memory_table(module, depth=, dtype=)``; an unknown ``dtype`` is a one-line UsageError."""
    from jupyter_metainit.estimates import memory_table

    kwargs: dict[str, Any] = {}
    if depth is not None:
        kwargs["depth"] = depth
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return memory_table(module, **kwargs)
    except ValueError as exc:
        if dtype is not None and str(exc).startswith("unknown dtype"):
            raise UsageError(f"--dtype: {str(exc).splitlines()[0]}") from None
        raise


def _show(name: str, module: nn.Module, *, table: bool, depth: int | None) -> None:
    """Print the summary line, then display the tree widget, else (or with ``table``) the table.

    The cell itself has run fine by now, so a failure to display is reported in one line on
    stderr (and the next view is tried) instead of failing the cell.
    """
    views = [_summary] if table else [_summary, _widget]
    views.append(_table)
    for view in views:
        try:
            shown = view(name, module, depth)
        except Exception as exc:
            message = (str(exc).splitlines() or [""])[0][:120]
            print(
                f"jupyter_metainit: could not show {name} as a {view.__name__.strip('_')} "
                f"({type(exc).__name__}: {message})",
                file=sys.stderr,
            )
            continue
        if shown is not None:
            display(shown)
            return


def _summary(name: str, module: nn.Module, depth: int | None) -> None:
    print(summary_line(name, module))


def _widget(name: str, module: nn.Module, depth: int | None) -> Any:
    from jupyter_metainit.jupyter.widget import explore

    return explore(module, name=name) if depth is None else explore(module, depth=depth, name=name)


def _table(name: str, module: nn.Module, depth: int | None) -> Any:
    return _memory_table(module, depth, None)


@magics_class
class MetaInitMagics(Magics):
    """The magics of ``jupyter_metainit``; registered by ``%load_ext jupyter_metainit``."""

    shell: InteractiveShell

    def _evaluate(self, magic: str, expr: str) -> Any:
        """Evaluate ``expr`` in the user namespace; a bad name is a UsageError, not a traceback."""
        if not expr:
            raise UsageError(f"%{magic}: missing EXPR (e.g. %{magic} model.layers[0])")
        try:
            return self.shell.ev(expr)
        except Exception as exc:  # whatever EXPR raises is the user's mistake, not ours
            text = str(exc).splitlines()[0] if str(exc).strip() else ""
            message = f"{text} ({type(exc).__name__})" if text else type(exc).__name__
            raise UsageError(f"%{magic}: cannot evaluate {expr!r}: {message}") from None

    def _target(self, magic: str, line: str) -> tuple[str, Any, Any]:
        """Split ``line`` into EXPR and options, evaluate EXPR, check it is a module/tensor."""
        parser = getattr(self, magic).parser

        def takes_value(option: str) -> bool:
            action = parser._option_string_actions.get(option)
            return action is not None and action.nargs != 0

        expr, options = split_expression(line, takes_value)
        args = parse_argstring(getattr(self, magic), options)
        if args.expr:
            raise UsageError(f"%{magic}: unexpected argument(s) {' '.join(args.expr)!r}")
        obj = self._evaluate(magic, expr)
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        if not items or not all(isinstance(o, (nn.Module, torch.Tensor)) for o in items):
            raise UsageError(
                f"%{magic}: {expr} is a {type(obj).__name__}, "
                "not a torch.nn.Module, a Tensor or a list of them"
            )
        for item in items:
            if isinstance(item, nn.Module) and not is_set_up(item):
                raise UsageError(f"%{magic}: " + not_set_up_note(expr, item, "refused"))
        return expr, obj, args

    @magic_arguments()
    @argument("--no-display", action="store_true", help="Do not show anything after the cell.")
    @argument(
        "--table",
        action="store_true",
        help="Show the memory table (pandas) instead of the interactive tree widget.",
    )
    @argument(
        "--device",
        metavar="DEV",
        help="Device the deferred tensors report and materialize to by default "
        "(cpu, cuda, cuda:1). Default: the device each factory names, else cpu.",
    )
    @argument(
        "--dtype",
        metavar="DT",
        help="Default floating dtype while the cell runs (bfloat16, float16, float32, float64).",
    )
    @argument("--depth", metavar="N", type=int, help="Depth of the tree/table shown (0 = root).")
    @cell_magic
    def meta_init(self, line: str, cell: str) -> None:
        """Run the cell with every tensor deferred (no memory), then show the new models.

        The cell runs like any other cell (magics, ``!cmd``, last expression displayed,
        variables in your namespace), but inside ``jupyter_metainit.meta_init()``: parameters
        and buffers get their shape, dtype and device without storage. Afterwards each
        ``torch.nn.Module`` bound to a new top-level name is shown as a tree you can explore and
        materialize from (or as a memory table with ``--table``). If the cell raises, it fails
        like a normal cell; whatever it had built before the error stays deferred and usable.

        Example::

            %%meta_init --dtype bfloat16
            model = AutoModelForCausalLM.from_config(config)
        """
        __tracebackhide__ = True
        from jupyter_metainit.core import meta_init

        args = parse_argstring(self.meta_init, strip_comment(line))
        device = parse_device(args.device)
        dtype = parse_dtype(args.dtype, default_dtypes_only=True)
        depth = parse_depth(args.depth)

        before = dict(self.shell.user_ns)
        with meta_init(device=device, dtype=dtype):
            ok = run_cell_body(self.shell, cell)
        if not ok or args.no_display:
            return
        for name, module in new_bindings(before, self.shell.user_ns).items():
            if not is_set_up(module):
                print(not_set_up_note(name, module, "not shown"))
        for name, module in new_modules(before, self.shell.user_ns).items():
            _show(name, module, table=args.table, depth=depth)

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR", help="Module, tensor or list of them.")
    @argument("--device", metavar="DEV", help="Target device (default: the reported device).")
    @argument("--dtype", metavar="DT", help="Cast floating tensors to this dtype.")
    @argument(
        "--rng",
        choices=("exact", "fast"),
        default=None,
        help="exact: bit-identical to eager construction (the default, except that parts "
        "freed while holding fast values get those back); fast: independent per-op random "
        "streams, parallel.",
    )
    @line_magic
    def materialize(self, line: str) -> None:
        """Materialize EXPR in place: allocate and compute its deferred tensors exactly.

        EXPR is evaluated in your namespace, e.g. ``%materialize model.model.layers[0]``.
        Prints what it did; the module/tensor itself is changed in place, and
        ``%dematerialize EXPR`` can make it deferred again.
        """
        __tracebackhide__ = True
        from jupyter_metainit.core import materialize

        expr, obj, args = self._target("materialize", line)
        device = parse_device(args.device, available=True)
        dtype = parse_dtype(args.dtype)
        start = time.perf_counter()
        # keep_cache: so that %dematerialize can make it deferred again later.
        _one_line_errors(
            "materialize", lambda: materialize(obj, device, dtype=dtype, rng=args.rng,
                                               keep_cache=True),
            {"device='cpu'": f" With the magic: %materialize {expr} --device cpu"},
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        print(f"materialized {summary_line(expr, obj)} in {format_duration(elapsed)}")

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR", help="Module, tensor or list of them.")
    @argument(
        "--force",
        action="store_true",
        help="Drop tensors even if they were modified since materialization.",
    )
    @line_magic
    def dematerialize(self, line: str) -> None:
        """Make EXPR deferred again and free its memory; it can be materialized again later.

        Refuses (with an error) if a tensor was modified since it was materialized, unless
        ``--force`` is given.
        """
        __tracebackhide__ = True
        from jupyter_metainit.core import dematerialize

        expr, obj, args = self._target("dematerialize", line)
        _one_line_errors(
            "dematerialize",
            lambda: dematerialize(obj, force=args.force),
            {"force=True": f" With the magic: %dematerialize {expr} --force"},
        )
        print(f"dematerialized {summary_line(expr, obj)}")

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR", help="Module to tabulate.")
    @argument("--depth", metavar="N", type=int, help="Module depth of the rows (0 = root).")
    @argument(
        "--dtype",
        metavar="DT",
        help="Estimate sizes as if floating tensors had this dtype (bf16, fp16, int8, int4...).",
    )
    @argument("--full", action="store_true", help="Show every column (default: compact).")
    @line_magic
    def meta_table(self, line: str) -> Any:
        """Return the memory table (a pandas DataFrame) of the module EXPR.

        Works on deferred, partly and fully materialized modules: one row per submodule down to
        ``--depth``, with parameter counts, bytes and where the tensors are. Use
        ``df = %meta_table model --depth 2`` to keep the DataFrame.
        """
        __tracebackhide__ = True
        expr, obj, args = self._target("meta_table", line)
        if not isinstance(obj, nn.Module):
            kind = "tensor" if isinstance(obj, torch.Tensor) else type(obj).__name__
            raise UsageError(f"%meta_table: {expr} is a {kind}, not a torch.nn.Module")
        table = _memory_table(obj, parse_depth(args.depth), args.dtype)
        return table.full() if args.full else table


def _one_line_errors(magic: str, action: Any, hints: dict[str, str] | None = None) -> None:
    """Run ``action``; a refusal or failure of the core is one ``UsageError`` line, raised
    outside the handler so that nothing of the failed work stays reachable from it.

    ``hints``: when the core's message names an argument (``force=True``), the magic's
    spelling of it is added."""
    __tracebackhide__ = True
    from jupyter_metainit.core.errors import MetaInitError

    message = None
    try:
        action()
    except (MetaInitError, ValueError, TypeError, OSError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for argument, hint in (hints or {}).items():
            if argument in text:
                text += hint
        message = f"%{magic}: {text}"
    if message is not None:
        raise UsageError(message)


def _magic_names() -> Iterable[tuple[str, str]]:
    for kind, names in MetaInitMagics.magics.items():
        for name in names:
            yield kind, name


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register the magics (``%load_ext jupyter_metainit``); loading twice replaces them."""
    unload_ipython_extension(ipython)
    ipython.register_magics(MetaInitMagics)
    install_short_tracebacks(ipython)
    # from the next cell on, widgets know when a cell runs (their clicks wait for it)
    watch_cells(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """Remove the magics again (``%unload_ext``); nothing else is left registered."""
    manager = ipython.magics_manager
    for kind, name in _magic_names():
        bound = manager.magics[kind].get(name)
        owner = getattr(bound, "__self__", None)
        if owner is not None and type(owner).__name__ == MetaInitMagics.__name__:
            del manager.magics[kind][name]
    manager.registry.pop(MetaInitMagics.__name__, None)
    uninstall_short_tracebacks(ipython)
