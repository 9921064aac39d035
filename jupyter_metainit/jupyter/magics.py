"""IPython magics: ``%%meta_init``, ``%materialize``/``%dematerialize``, ``%meta_table``,
``%place``, ``%save``. Load them with ``%load_ext jupyter_metainit``.

Each magic is a thin layer over the core API: ``%%meta_init`` runs its cell under
:func:`meta_init` (with normal cell semantics) and then shows every ``torch.nn.Module`` the cell
bound to a new top-level name; the line magics evaluate an expression in the user namespace and
call :func:`materialize`, :func:`dematerialize` or ``memory_table`` on it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from torch import nn

from jupyter_metainit.core import (
    dematerialize,
    format_duration,
    materialize,
    meta_init,
    parse_path,
)
from jupyter_metainit.core.errors import ArgumentTypeError
from jupyter_metainit.jupyter.cell_models import (
    is_set_up,
    new_bindings,
    new_modules,
    not_set_up_note,
    summary_line,
)
from jupyter_metainit.jupyter.cell_runner import (
    install_short_tracebacks,
    run_cell_body,
    uninstall_short_tracebacks,
)
from jupyter_metainit.jupyter.cell_watch import watch_cells
from jupyter_metainit.jupyter.magic_options import (
    as_options,
    input_shapes,
    name_usage_errors,
    one_line_errors,
    parse_depth,
    parse_device,
    parse_dtype,
    split_expression,
    strip_comment,
)
from jupyter_metainit.jupyter.model_views import memory_table_usage, show_model
from jupyter_metainit.jupyter.value_magics import ValueMagics, unregister_value_magics
from jupyter_metainit.plan import place
from jupyter_metainit.plan.place_arguments import name_value_pairs
from jupyter_metainit.saving import save as save_checkpoint

__all__ = ["MetaInitMagics", "load_ipython_extension", "unload_ipython_extension"]
# %save's EXPR PATH: PATH is the last word, or a quoted string at the end (spaces, "#" in it)
_PATH_AT_THE_END = re.compile(r"""(.*?)\s*(?:"([^"]*)"|'([^']*)'|(\S*))""", re.DOTALL)


@magics_class
class MetaInitMagics(Magics):
    """The magics of ``jupyter_metainit``; registered by ``%load_ext jupyter_metainit``."""

    shell: InteractiveShell

    def __init__(self, shell: InteractiveShell | None = None, **kwargs: Any) -> None:
        # IPython's own %save (code to a file), which ours hands lines that name no model;
        # taken before ours replaces it, and put back by unload_ipython_extension.
        manager = getattr(shell, "magics_manager", None)
        self.ipython_save = manager.magics["line"].get("save") if manager is not None else None
        super().__init__(shell=shell, **kwargs)

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
            show_model(name, module, table=args.table, depth=depth)

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
        expr, obj, args = self._target("materialize", line)
        device = parse_device(args.device, available=True)
        dtype = parse_dtype(args.dtype)
        start = time.perf_counter()
        # keep_cache: so that %dematerialize can make it deferred again later.
        one_line_errors(
            "materialize",
            lambda: materialize(obj, device, dtype=dtype, rng=args.rng, keep_cache=True),
            {"device='cpu'": f" With the magic: %materialize {expr} --device cpu"},
        )
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
        expr, obj, args = self._target("dematerialize", line)
        one_line_errors(
            "dematerialize",
            lambda: dematerialize(obj, force=args.force),
            {"force=True": f" With the magic: %dematerialize {expr} --force"},
        )
        print(f"dematerialized {summary_line(expr, obj)}")

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR PATH", help="Module (or state dict), directory.")
    @argument(
        "--format",
        choices=("safetensors", "dcp"),
        default="safetensors",
        help="safetensors: what save_pretrained writes (default); dcp: "
        "torch.distributed.checkpoint.",
    )
    @argument("--dtype", metavar="DT", help="Cast floating tensors to this dtype as written.")
    @argument("--max-shard-size", metavar="SIZE", help="Most bytes a file holds (5GB; dcp: all).")
    @line_magic
    def save(self, line: str) -> None:
        """Write EXPR's values (what materialize would give) to directory PATH without
        materializing it: ``%save model "~/my dir" [--format dcp]`` (``~``, ``$VARS`` expanded).

        Tensor by tensor in bounded memory, with a progress bar; the model is not changed. A
        line that names no model (``%save -r notes.py 1-5``) goes to IPython's own ``%save``.
        """
        __tracebackhide__ = True
        expr, options = split_expression(line, lambda option: option != "--help")
        expr, *paths = _PATH_AT_THE_END.fullmatch(expr.strip()).groups()  # type: ignore[union-attr]
        path = next(p for p in paths if p is not None)
        if not expr and self._model_or_none(path) is not None:
            raise UsageError(f"%save: missing PATH (e.g. %save {path} ./checkpoint)")
        obj = self._model_or_none(expr)
        if obj is None and self.ipython_save is not None and self._history_save(line):
            return self.ipython_save(line)
        if obj is None:
            raise UsageError(
                f"%save: {self._not_a_model(expr)}; usage: %save EXPR PATH [--format dcp] (EXPR "
                "a module or a dict of tensors, PATH the directory to write; IPython's own "
                "%save FILENAME RANGES saves input history)"
            )
        args = parse_argstring(self.save, options)
        if args.expr:
            raise UsageError(f"%save: unexpected argument(s) {' '.join(args.expr)!r}")
        dtype = parse_dtype(args.dtype)
        start, destination = time.perf_counter(), parse_path(path, "PATH", typed=True)
        one_line_errors(
            "save",
            lambda: save_checkpoint(
                obj,
                destination,
                format=args.format,
                max_shard_size=args.max_shard_size,
                dtype=dtype,
                progress=True,
            ),
        )
        elapsed = time.perf_counter() - start
        print(f"saved {expr} to {destination} ({args.format}) in {format_duration(elapsed)}")

    def _history_save(self, line: str) -> bool:
        """Is ``line`` one for IPython's own ``%save`` (history ranges it can find)?"""
        opts, args = self.parse_options(line, "fra", mode="list")
        try:
            self.shell.find_user_code(" ".join(args[1:]), raw="r" in opts, py_only=True)
        except (TypeError, ValueError, IndexError):
            return False
        return True

    def _not_a_model(self, expr: str) -> str:
        try:
            value = self.shell.ev(expr)
        except Exception as exc:
            return f"cannot evaluate {expr!r}: {exc} ({type(exc).__name__})"
        if isinstance(value, torch.Tensor):
            return f"{expr} is a tensor, not a module: save a dict, %save {{'w': {expr}}} PATH"
        return f"{expr} is a {type(value).__name__}, not a module"

    def _model_or_none(self, expr: str) -> Any:
        """EXPR's value if it is a module or a dict of tensors (what %save writes), else None."""
        if not expr or expr.startswith("-"):
            return None
        try:
            obj = self.shell.ev(expr)
        except Exception:  # not ours to save: IPython's %save reads its own arguments
            return None
        if isinstance(obj, nn.Module):
            return obj
        if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
        return None

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
        table = memory_table_usage(obj, parse_depth(args.depth), args.dtype)
        return table.full() if args.full else table

    @magic_arguments()
    @argument("expr", nargs="*", metavar="EXPR", help="Model to place.")
    @argument(
        "--devices",
        metavar="DEVS",
        default="auto",
        help="Devices and capacities in pipeline order: cuda:0=80GiB,cuda:1=80GiB,cpu=256GiB "
        "(bytes, GiB or GB), or auto (the free memory of the visible devices; default).",
    )
    @argument("--batch", metavar="N", type=int, default=1, help="Samples per step (default 1).")
    @argument("--seq-len", metavar="N", type=int, help="Tokens per sample (prompt + generated).")
    @argument("--inputs", metavar="SHAPES", help="Or the inputs' shapes: '(8, 3, 224, 224)'.")
    @argument(
        "--training", action="store_true", help="Plan one training step (default: inference)."
    )
    @argument(
        "--optimizer", metavar="OPT", default="adamw", help="adamw, adam, sgd, ... (training)."
    )
    @argument("--precision", metavar="P", help="bf16, fp16, fp32, bf16-mixed, bf16-master.")
    @argument("--pin", metavar="PINS", help="Parts fixed to a device: lm_head=cuda:0,...")
    @argument("--strategy", metavar="S", default="pipeline", help="pipeline (default) or fsdp.")
    @argument("--world-size", metavar="N", type=int, help="Ranks, with --strategy fsdp.")
    @argument("--table", action="store_true", help="Return the per-device, per-part table.")
    @line_magic
    def place(self, line: str) -> Any:
        """Plan where each part of the model EXPR goes for a workload, allocating nothing.

        ``%place model --devices cuda:0=80GiB,cuda:1=80GiB --batch 4 --seq-len 4096`` shows the
        predicted peak of every device against its capacity (``jupyter_metainit.place``);
        ``plan = %place ...`` keeps the plan (``plan.device_map``, ``plan.table``), and
        ``materialize(model, placement=plan)`` puts every part onto its device.
        """
        __tracebackhide__ = True
        expr, obj, args = self._target("place", line)
        if not isinstance(obj, nn.Module):
            raise UsageError(f"%place: {expr} is a {type(obj).__name__}, not a torch.nn.Module")

        def plan_it() -> Any:
            devices = (
                args.devices
                if args.devices == "auto"
                else name_value_pairs(
                    args.devices or "", option="--devices", example="cuda:0=80GiB,cpu=256GiB"
                )
            )
            pins = name_value_pairs(args.pin or "", option="--pin", example="lm_head=cuda:0")
            return place(
                obj,
                devices,
                batch=args.batch,
                seq_len=args.seq_len,
                inputs=input_shapes(args.inputs),
                training=args.training,
                optimizer=args.optimizer,
                precision=args.precision,
                pin=pins or None,
                strategy=args.strategy,
                world_size=args.world_size,
            )

        plan = one_line_errors("place", plan_it, reword=as_options)
        return plan.table if args.table else plan


def _magic_names() -> Iterable[tuple[str, str]]:
    for kind, names in MetaInitMagics.magics.items():
        for name in names:
            yield kind, name


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register the magics: what ``%load_ext jupyter_metainit`` calls.

    Use ``%load_ext jupyter_metainit`` in a notebook (IPython calls this) for ``%%meta_init``,
    ``%materialize``, ``%dematerialize``, ``%meta_table``, ``%place``, ``%save``, ``%stats``
    and ``%compare``. Loading twice replaces them.

    Args:
        ipython: the running IPython shell.

    Examples:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> shell = InteractiveShell.instance()
        >>> shell.run_line_magic("load_ext", "jupyter_metainit")
        >>> "meta_init" in shell.magics_manager.magics["cell"]
        True
        >>> shell.run_line_magic("unload_ext", "jupyter_metainit")
    """
    unload_ipython_extension(ipython)
    ipython.register_magics(*name_usage_errors(MetaInitMagics, ValueMagics))  # + %stats, %compare
    install_short_tracebacks(ipython)
    # from the next cell on, widgets know when a cell runs (their clicks wait for it)
    watch_cells(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """Remove the magics again: what ``%unload_ext jupyter_metainit`` calls.

    Nothing of the extension is left registered (IPython's own ``%save`` comes back); models
    and widgets already made stay as they are.

    Args:
        ipython: the running IPython shell.

    Examples:
        >>> from IPython.core.interactiveshell import InteractiveShell
        >>> shell = InteractiveShell.instance()
        >>> shell.run_line_magic("load_ext", "jupyter_metainit")
        >>> shell.run_line_magic("unload_ext", "jupyter_metainit")
        >>> "meta_init" in shell.magics_manager.magics["cell"]
        False
    """
    if not isinstance(ipython, InteractiveShell):  # load_ipython_extension's check too
        raise ArgumentTypeError(f"ipython takes IPython's InteractiveShell, not {ipython!r}")
    manager = ipython.magics_manager
    for kind, name in _magic_names():
        bound = manager.magics[kind].get(name)
        owner = getattr(bound, "__self__", None)
        if owner is not None and type(owner).__name__ == MetaInitMagics.__name__:
            del manager.magics[kind][name]
            original = getattr(owner, "ipython_save", None)
            if kind == "line" and name == "save" and original is not None:
                manager.magics[kind][name] = original  # IPython's own %save again
    manager.registry.pop(MetaInitMagics.__name__, None)
    unregister_value_magics(ipython)
    uninstall_short_tracebacks(ipython)
