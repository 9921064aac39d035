"""Parse and validate the values given to the magics' options, with one-line ``UsageError``s."""

from __future__ import annotations

import ast
import difflib
import io
import re
import tokenize
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from jupyter_metainit.core import missing_device_reason
from jupyter_metainit.core import parse_device as device_from_text
from jupyter_metainit.core import parse_dtype as dtype_from_name
from jupyter_metainit.core.errors import ArgumentError, MetaInitError

__all__ = [
    "MAX_DIMENSION",
    "as_options",
    "input_shapes",
    "name_usage_errors",
    "one_line_errors",
    "parse_depth",
    "parse_device",
    "parse_dtype",
    "split_expression",
    "strip_comment",
]

#: the largest batch, sequence length or input dimension a plan is asked for
MAX_DIMENSION = 1 << 20

#: dtypes ``meta_init`` can use as the default floating dtype of a block.
DEFAULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def parse_dtype(text: str | None, *, default_dtypes_only: bool = False) -> torch.dtype | None:
    """``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"`` -> ``torch.bfloat16``; None stays None."""
    if text is None:
        return None
    try:
        value = dtype_from_name(text, "--dtype")
    except ValueError:
        value = None
    allowed = DEFAULT_DTYPES if default_dtypes_only else None
    if (
        not isinstance(value, torch.dtype)
        or not value.is_floating_point
        or (allowed is not None and value not in allowed)
    ):
        raise UsageError(
            f"--dtype: {text!r} is not a usable floating dtype "
            "(try bfloat16, float16, float32 or float64)"
        )
    return value


def parse_device(text: str | None, *, available: bool = False) -> torch.device | None:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"`` -> ``torch.device``; None stays None.

    ``available``: the device must exist here (materializing), not just be a device name
    (recording for a GPU on a machine without one is fine).
    """
    if text is None:
        return None
    try:
        device = device_from_text(text)
    except ValueError:
        raise UsageError(f"--device: {text!r} is not a device (try cpu, cuda, cuda:1)") from None
    assert device is not None
    if device.type == "meta":
        raise UsageError("--device: 'meta' is not a real device; deferred tensors need one")
    reason = missing_device_reason(device) if available else None
    if reason is not None:
        if device.type != "cuda":
            raise UsageError(f"--device: {text!r} is not available here; use cpu or cuda:N")
        if not torch.cuda.is_available():
            raise UsageError(f"--device: {text!r}: {reason}; use --device cpu")
        raise UsageError(f"--device: {text!r}: {reason}")
    return device


def parse_depth(value: int | None) -> int | None:
    """Check ``--depth`` (already an int from argparse) is not negative."""
    if value is not None and value < 0:
        raise UsageError(f"--depth: must be 0 or more, got {value}")
    return value


def strip_comment(line: str) -> str:
    """``"lin  # --force"`` -> ``"lin"``: a ``#`` outside string literals starts a comment.

    Python's tokenizer decides, so ``d["#1"]`` keeps its key; a line it cannot read
    (unterminated string) falls back to a scan that skips quoted text.
    """
    if "#" not in line:
        return line
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    else:
        return line
    for i, char in _outside_strings(line):
        if char == "#":
            return line[:i].rstrip()
    return line


def _outside_strings(line: str) -> Iterator[tuple[int, str]]:
    """``(index, character)`` of every character of ``line`` outside string literals (quotes,
    triple quotes and backslash escapes skipped), for the scans that must not look inside them."""
    quote: str | None = None
    i = 0
    while i < len(line):
        char = line[i]
        if quote is not None:
            if char == "\\":
                i += 2
                continue
            if line.startswith(quote, i):
                i += len(quote)
                quote = None
                continue
        elif char in "\"'":
            quote = line[i : i + 3] if line[i : i + 3] in ('"""', "'''") else char
            i += len(quote)
            continue
        else:
            yield i, char
        i += 1


_WORD = re.compile(r"\S+")


def _is_option(word: str) -> bool:
    return len(word) > 1 and word[0] == "-" and (word[1].isalpha() or word[1] == "-")


def split_expression(
    line: str, takes_value: Callable[[str], bool] = lambda option: False
) -> tuple[str, str]:
    """Split ``"model.layers[0] --device cpu"`` into the Python expression and the options.

    A comment (``# ...``) is dropped first. Options may come before the expression
    (``--device cpu model``; ``takes_value(option)`` says whether an option reads the next
    word) or after it: there the expression ends at the first `` -x``/`` --x`` outside
    brackets and string literals, so expressions keep their quotes and spaces
    (``d["a b"]``, ``[m.a, m.b]``, ``layers[-1]``).
    """
    line = strip_comment(line)
    leading_end = 0
    words = list(_WORD.finditer(line))
    i = 0
    while i < len(words) and _is_option(words[i].group()):
        option = words[i].group()
        i += 1
        if "=" not in option and takes_value(option) and i < len(words):
            i += 1
        leading_end = words[i - 1].end()
    expression, trailing = _split_trailing(line[leading_end:])
    return expression, f"{line[:leading_end].strip()} {trailing}".strip()


def _split_trailing(line: str) -> tuple[str, str]:
    """The expression and the options after it (see :func:`split_expression`)."""
    depth = 0
    for i, char in _outside_strings(line):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif (
            depth == 0
            and char == "-"
            and (i == 0 or line[i - 1].isspace())
            and i + 1 < len(line)
            and (line[i + 1].isalpha() or line[i + 1] == "-")
        ):
            return line[:i].strip(), line[i:].strip()
    return line.strip(), ""


def input_shapes(text: Any) -> list[tuple[int, ...]] | None:
    """A workload's input shapes as typed (the plan bar's Inputs, ``%place --inputs``): one
    shape ``(8, 3, 224, 224)`` or several, batch included, for ``place(inputs=...)``; None when
    empty. Anything else is a ValueError with an example."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, str):  # a magic's argument keeps its quotes: '(8, 3, 224, 224)'
        text = text.strip()
        if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
    try:
        value = ast.literal_eval(text) if isinstance(text, str) else None
    except (ValueError, SyntaxError):
        value = None
    shapes = [value] if _is_shape(value) else value
    if not isinstance(shapes, (list, tuple)) or not shapes or not all(map(_is_shape, shapes)):
        raise ArgumentError(
            "Refused: Inputs must be shapes of whole numbers, e.g. (8, 3, 224, 224), or "
            f"(8, 3, 224, 224), (8,) for two inputs; not {text!r}."
        )
    return [tuple(shape) for shape in shapes]


def _is_shape(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(type(d) is int and 1 <= d <= MAX_DIMENSION for d in value)
    )


def as_options(text: str) -> str:
    """A core message in the magic's words: ``seq_len=`` is ``--seq-len N``, ``inputs=`` is
    ``--inputs``."""
    text = text.replace("place(..., seq_len=)", "--seq-len").replace("seq_len=", "--seq-len ")
    return re.sub(r"inputs=(\[\(.*?\)\])", r"--inputs '\1'", text).replace("inputs=", "--inputs ")


def one_line_errors(
    magic: str,
    action: Any,
    hints: dict[str, str] | None = None,
    reword: Callable[[str], str] | None = None,
) -> Any:
    """Run ``action`` and return what it returns; a refusal or failure of the core is one
    ``UsageError`` line, raised outside the handler so that nothing of the failed work stays
    reachable from it.

    ``hints``: when the core's message names an argument (``force=True``), the magic's
    spelling of it is added; ``reword``: the message in the magic's words (:func:`as_options`)."""
    __tracebackhide__ = True
    message = None
    try:
        return action()
    except (MetaInitError, ValueError, TypeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.filename is None and exc.strerror:
            text = exc.strerror  # already in the user's words: no "[Errno n]"
        else:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for argument, hint in (hints or {}).items():
            if argument in text:
                text += hint
        if reword is not None:
            text = reword(text)
        message = f"%{magic}: {text}"
    if message is not None:
        raise UsageError(message)


# --------------------------------------------------------------------------- option mistakes

_UNRECOGNIZED = "unrecognized arguments: "
_INVALID_CHOICE = re.compile(r"argument (\S+): invalid choice: '([^']*)'")
MagicsClass = TypeVar("MagicsClass", bound=type)


class _NamedMagicParser(MagicArgumentParser):
    """IPython's magic parser whose mistakes name the magic (``%%meta_init: ...``) and, for a
    mistyped option or choice, the closest one (``--depht`` -> ``--depth``)."""

    magic = ""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(option_mistake_in_words(self.magic or self.prog, message, self))


def option_mistake_in_words(magic: str, message: str, parser: Any) -> str:
    """An argparse complaint as one line naming ``magic``, with the closest option or choice.

    ``"unrecognized arguments: --depht 2"`` of ``%meta_table`` becomes ``"%meta_table: unknown
    option --depht; did you mean --depth? (its options: --depth, --dtype, --full)"``.
    """
    options = sorted(
        {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    )
    if message.startswith(_UNRECOGNIZED):
        words = message[len(_UNRECOGNIZED) :].split()
        unknown = next((w for w in words if w.startswith("-")), None)
        if unknown is None:
            return f"{magic}: unexpected argument(s) {' '.join(words)!r}"
        typed = unknown.split("=", 1)[0]
        close = difflib.get_close_matches(typed, options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        listed = f" (its options: {', '.join(options)})" if options else ""
        return f"{magic}: unknown option {typed}{hint}{listed}"
    choice = _INVALID_CHOICE.match(message)
    if choice is not None:
        action = parser._option_string_actions.get(choice.group(1))
        choices = [str(c) for c in (getattr(action, "choices", None) or [])]
        close = difflib.get_close_matches(choice.group(2), choices, n=1, cutoff=0.5)
        if close:
            return f"{magic}: {message}; did you mean {close[0]!r}?"
    return f"{magic}: {message}"


def name_usage_errors(*classes: MagicsClass) -> tuple[MagicsClass, ...]:
    """The ``@magics_class`` classes given, each magic's option mistakes (unknown option, bad
    value, missing value) now one ``UsageError`` line that names the magic and suggests the
    closest option: one place for all the extension's magics, applied as they are registered
    (``ipython.register_magics(*name_usage_errors(A, B))``; applying it again changes nothing).
    """
    for magics in classes:
        for kind, names in magics.magics.items():  # type: ignore[attr-defined]
            prefix = "%%" if kind == "cell" else "%"
            for name, method in names.items():
                parser = getattr(getattr(magics, method, None), "parser", None)
                if isinstance(parser, MagicArgumentParser):
                    parser.__class__ = _NamedMagicParser
                    parser.magic = f"{prefix}{name}"
    return classes
