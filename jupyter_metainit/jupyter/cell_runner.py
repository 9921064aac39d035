"""Run the body of a cell magic exactly like a normal notebook cell.

Used by ``%%meta_init``: the body goes through IPython's input transformers (so ``!cmd``,
``%line_magics`` and nested cell magics work), its last expression is displayed, names land in
the user namespace, and an exception shows one traceback that names the user's line and fails
the *enclosing* cell (so "Run All" and ``nbclient`` stop there) without being raised a second time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import types
from collections.abc import Coroutine, Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionResult, InteractiveShell

__all__ = [
    "CellFailed",
    "install_short_tracebacks",
    "run_cell_body",
    "uninstall_short_tracebacks",
]


class CellFailed(Exception):
    """The cell body raised; its traceback was already shown and the enclosing cell marked failed.

    Only raised when there is no enclosing cell to mark (the magic was called from Python code,
    e.g. ``get_ipython().run_cell_magic(...)``), so that such callers still see an exception.
    """


# Frames of this package, and of installed libraries (torch): what a traceback hides below the
# last line of the user's own code.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(
    {
        os.path.abspath(p) + os.sep
        for key in ("purelib", "platlib", "stdlib")
        if (p := sysconfig.get_paths().get(key))
    }
)


def _is_ours(frame: types.FrameType) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR)


def _is_library(frame: types.FrameType) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS)


def user_traceback(error: BaseException) -> None:
    """Make ``error`` show one short traceback ending at the user's line: this package's frames
    (recording, replay), the library frames between the user's last line and ours (torch's
    ``Module.__call__``, ``Linear.forward``) and what ours called are cut off, and an exception
    our code was handling when the error arose (a meta kernel's refusal before the real op ran)
    is not chained in.

    A user's own function called from our frames (a hook) stays, from its first frame on.
    """
    frames: list[types.TracebackType] = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    first_ours = next((i for i, t in enumerate(frames) if _is_ours(t.tb_frame)), None)
    if first_ours is None:
        return
    later_user = next(
        (
            i
            for i in range(first_ours, len(frames))
            if not _is_ours(frames[i].tb_frame) and not _is_library(frames[i].tb_frame)
        ),
        None,
    )

    def user(i: int) -> bool:
        return not _is_ours(frames[i].tb_frame) and not _is_library(frames[i].tb_frame)

    # End at the user's last line before ours (`y = m(x)`), not in torch's module machinery.
    last_user = next((i for i in reversed(range(first_ours)) if user(i)), first_ours - 1)
    kept = frames[: last_user + 1] + (frames[later_user:] if later_user is not None else [])
    rebuilt: types.TracebackType | None = None
    for t in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    error.__traceback__ = rebuilt
    context = error.__context__
    caught_by_us = (
        context is not None
        and context.__traceback__ is not None
        and _is_ours(context.__traceback__.tb_frame)
    )
    if later_user is None or caught_by_us:
        error.__suppress_context__ = True  # what we were handling is ours, not the user's


def _short_showtraceback(original: Any) -> Any:
    """``shell.showtraceback`` that makes a traceback a user traceback before showing it."""

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        etype, value, _tb = exc_tuple if exc_tuple is not None else sys.exc_info()
        if value is not None and not isinstance(value, SyntaxError):
            user_traceback(value)
            exc_tuple = (etype, value, value.__traceback__)
        return original(exc_tuple, *args, **kwargs)

    showtraceback._jmi_short = True  # type: ignore[attr-defined]
    return showtraceback


def install_short_tracebacks(shell: InteractiveShell) -> None:
    """Every cell's traceback is a user traceback while the extension is loaded: a torch error
    on a deferred model in a plain cell (``y = model(x)`` after ``%%meta_init``) ends at the
    user's line too. Tracebacks with none of this package's frames are shown unchanged."""
    if not getattr(shell.__dict__.get("showtraceback"), "_jmi_short", False):
        shell.showtraceback = _short_showtraceback(shell.showtraceback)  # type: ignore[method-assign]


def uninstall_short_tracebacks(shell: InteractiveShell) -> None:
    if getattr(shell.__dict__.get("showtraceback"), "_jmi_short", False):
        del shell.showtraceback  # the class's method again


@contextlib.contextmanager
def _user_tracebacks(shell: InteractiveShell) -> Iterator[None]:
    """While the body runs, tracebacks IPython shows are made user tracebacks first."""
    own = shell.__dict__.get("showtraceback")  # set by an enclosing %%meta_init, if any
    if getattr(own, "_jmi_short", False):  # already short (the extension's or an outer cell's)
        yield
        return
    shell.showtraceback = _short_showtraceback(shell.showtraceback)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is not None:
            shell.showtraceback = own  # type: ignore[method-assign]
        else:
            del shell.showtraceback  # the class's method again


def _drive(coro: Coroutine[Any, Any, bool]) -> bool:
    """Run a coroutine that never suspends (IPython's own ``_pseudo_sync_runner`` contract)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return bool(stop.value)
    coro.close()
    raise RuntimeError("the cell body tried to suspend; top-level await is not supported")


def _is_async(code: str) -> bool:
    try:
        from IPython.core.async_helpers import _should_be_async
    except ImportError:  # pragma: no cover - older/newer IPython without the helper
        return False
    return _should_be_async(code)


def _prefix_lines(enclosing: ExecutionResult | None, body: str) -> list[str]:
    """Lines that precede the body in the notebook cell (``%%meta_init ...`` and blank lines).

    The body is cached with these lines in front of it, so tracebacks say "Cell In[5], line 3"
    for the third line of the notebook cell, as for any other cell.
    """
    raw = enclosing.info.raw_cell if enclosing is not None and enclosing.info else None
    lines = raw.splitlines() if raw else []
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("%%meta_init")]
    starts = starts or [i for i, line in enumerate(lines) if line.lstrip().startswith("%%")]
    prefix = lines[: starts[0] + 1] if starts else ["%%"]
    # IPython strips the body's leading blank lines before compiling it: keep them as padding.
    for line in body.splitlines():
        if line.strip():
            break
        prefix.append("")
    return prefix


def run_cell_body(shell: InteractiveShell, body: str) -> bool:
    """Run ``body`` as the code of the cell currently executing; return True if it succeeded.

    On failure the traceback has been shown once and the enclosing cell's ``ExecutionResult``
    carries the error, so the front-end reports the cell as failed.
    """
    __tracebackhide__ = True
    enclosing: ExecutionResult | None = shell.displayhook.exec_result
    result = enclosing if enclosing is not None else ExecutionResult(None)

    try:
        transformed = shell.transform_cell(body)
    except Exception as exc:
        shell.showtraceback()
        result.error_before_exec = exc
        return _finish(result, enclosing)
    if _is_async(transformed):
        raise UsageError("top-level `await` is not supported inside %%meta_init")

    prefix = _prefix_lines(enclosing, body)
    number = enclosing.execution_count if enclosing is not None else shell.execution_count
    number = number if number is not None else shell.execution_count
    compiler = shell.compile
    cell_name = compiler.cache("\n".join(prefix) + "\n" + transformed, number, raw_code=body)
    try:
        tree = compiler.ast_parse("\n" * len(prefix) + transformed, filename=cell_name)
    except IndentationError as exc:
        shell.showindentationerror()
        result.error_before_exec = exc
        return _finish(result, enclosing)
    except (OverflowError, SyntaxError, ValueError, TypeError, MemoryError) as exc:
        shell.showsyntaxerror()
        result.error_before_exec = exc
        return _finish(result, enclosing)
    try:
        tree = shell.transform_ast(tree)
    except Exception as exc:
        shell.showtraceback()
        result.error_before_exec = exc
        return _finish(result, enclosing)

    interactivity = shell.ast_node_interactivity
    with _user_tracebacks(shell):
        _drive(
            shell.run_ast_nodes(
                tree.body, cell_name, interactivity=interactivity, compiler=compiler, result=result
            )
        )
    # A nested magic that runs a cell of its own (``%%capture``) resets this; restore it.
    shell.displayhook.exec_result = enclosing
    return _finish(result, enclosing)


def _finish(result: ExecutionResult, enclosing: ExecutionResult | None) -> bool:
    __tracebackhide__ = True
    if result.success:
        return True
    if enclosing is None:
        error = result.error_in_exec or result.error_before_exec
        raise CellFailed(f"the cell raised {type(error).__name__}: {error}") from error
    return False
