"""The one definition of the widget's tree rows, shared by the kernel and the page.

The tree travels as rows of arrays (one message for a whole 70B model stays small), so a
row's fields have positions. They are named here only: Python writes and reads rows through
:data:`ROW` / :func:`make_row`, and ``labextension/src/rows.ts`` is generated from this module
(``python -m jupyter_metainit.jupyter.row_schema > labextension/src/rows.ts``;
``tests/test_row_schema.py`` checks it is current). To add a field: append it here, regenerate,
rebuild the front end (``cd labextension && npm run build``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PATCH",
    "PATCH_FIELDS",
    "ROW",
    "ROW_FIELDS",
    "STATS_FIELDS",
    "make_row",
    "typescript_source",
]

# name -> TypeScript type, in row order. What each means: ModuleTree.to_json and NodeStats.
_ROW_TYPES: dict[str, str] = {
    "parent": "number",  # parent's node, -1 for the root
    "name": "string",  # local name ("" for the root)
    "type": "number",  # index into the tree's "types"
    "params": "number",
    "bytes": "number",
    "state": "string",
    "rep_i": "number",  # i-th of rep_n consecutive identical siblings
    "rep_n": "number",
    "info": "string",  # a leaf's extra_repr(), shortened
    "own": "number",  # 1 when the module holds tensors itself
    "dtype": "string",
    "share_bytes": "number",
    "target": "string",
    "tied": "number[]",  # the nodes sharing a tensor with this one
    "source": "string",
    "values": "string",
}
# Fields from here on may be missing on the page (trees of format 1 stopped at "own").
_FIRST_OPTIONAL = "dtype"

ROW_FIELDS: tuple[str, ...] = tuple(_ROW_TYPES)
ROW: dict[str, int] = {name: i for i, name in enumerate(ROW_FIELDS)}

# What a refresh recomputes (NodeStats' fields): a patch row is [node, *these].
STATS_FIELDS: tuple[str, ...] = (
    "params",
    "bytes",
    "state",
    "dtype",
    "share_bytes",
    "target",
    "source",
    "values",
)
PATCH_FIELDS: tuple[str, ...] = ("node", *STATS_FIELDS)
PATCH: dict[str, int] = {name: i for i, name in enumerate(PATCH_FIELDS)}
# Patch fields from here on may be missing (older kernels sent only the first four).
_FIRST_OPTIONAL_PATCH = "dtype"


def make_row(**fields: Any) -> list[Any]:
    """A tree row from its fields by name; every field must be given, no other."""
    missing = [f for f in ROW_FIELDS if f not in fields]
    extra = [f for f in fields if f not in ROW]
    if missing or extra:
        raise TypeError(f"tree row: missing fields {missing}, unknown fields {extra}")
    return [fields[f] for f in ROW_FIELDS]


def _ts_tuple(fields: tuple[str, ...], first_optional: str) -> str:
    optional = False
    parts = []
    for name in fields:
        optional = optional or name == first_optional
        ts = "number" if name == "node" else _ROW_TYPES[name]
        parts.append(f"{name}{'?' if optional else ''}: {ts}")
    return "[\n  " + ",\n  ".join(parts) + ",\n]"


def _ts_positions(fields: tuple[str, ...]) -> str:
    return "{\n" + "".join(f"  {name}: {i},\n" for i, name in enumerate(fields)) + "} as const"


def _ts_fields(fields: tuple[str, ...], first_optional: str) -> str:
    optional = False
    parts = []
    for name in fields:
        optional = optional or name == first_optional
        parts.append(f"  {name}{'?' if optional else ''}: {_ROW_TYPES[name]};\n")
    return "{\n" + "".join(parts) + "}"


def typescript_source() -> str:
    """The text of ``labextension/src/rows.ts``: the same positions and types, for the page."""
    return (
        "// GENERATED from jupyter_metainit/jupyter/row_schema.py; do not edit. Regenerate with\n"
        "// python -m jupyter_metainit.jupyter.row_schema > labextension/src/rows.ts\n\n"
        "/** A tree row's fields by position (ModuleTree.to_json). */\n"
        f"export const ROW = {_ts_positions(ROW_FIELDS)};\n\n"
        f"export type Row = {_ts_tuple(ROW_FIELDS, _FIRST_OPTIONAL)};\n\n"
        "/** A tree row's fields by name (what rowOf takes). */\n"
        f"export interface RowFields {_ts_fields(ROW_FIELDS, _FIRST_OPTIONAL)}\n\n"
        "/** A tree row from its fields by name, in the kernel's positions. */\n"
        "export function rowOf(f: RowFields): Row {\n"
        f"  return [{', '.join('f.' + name for name in ROW_FIELDS)}];\n"
        "}\n\n"
        "/** A patch row (a node whose statistics changed) by position. */\n"
        f"export const PATCH = {_ts_positions(PATCH_FIELDS)};\n\n"
        f"export type PatchRow = {_ts_tuple(PATCH_FIELDS, _FIRST_OPTIONAL_PATCH)};\n"
    )


if __name__ == "__main__":
    print(typescript_source(), end="")
