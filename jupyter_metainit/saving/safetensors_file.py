"""The safetensors file format, written as a stream: header first, then each tensor's bytes.

``safetensors.torch.save_file`` needs every tensor's bytes in memory at once. The header only
needs names, dtypes and shapes, so it can be written before any value exists; the bytes then
follow one tensor at a time. The layout matches ``save_file`` byte for byte: tensors ordered by
dtype (widest first, safetensors' ``Dtype`` order) then name, compact JSON with ``__metadata__``
first, the header padded with spaces to a multiple of 8 bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from jupyter_metainit.core.errors import ArgumentTypeError

__all__ = ["SAFETENSORS_DTYPES", "FileEntry", "file_order", "header_bytes"]

# torch dtype -> safetensors name, in safetensors' ``Dtype`` enum order (the file puts the
# highest first). Sub-byte and packed dtypes are left out: save_file refuses them too.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    **({torch.float8_e8m0fnu: "F8_E8M0"} if hasattr(torch, "float8_e8m0fnu") else {}),
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.complex64: "C64",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


@dataclass(frozen=True)
class FileEntry:
    """One tensor as the file will hold it: its name, dtype and shape (values come later)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def file_order(entries: list[FileEntry]) -> list[FileEntry]:
    """The order ``save_file`` lays tensors out in: widest dtype first, then by name."""
    for e in entries:
        if e.dtype not in _RANK:
            raise ArgumentTypeError(
                f"{e.name}: safetensors has no dtype {e.dtype}; save it with format='dcp', or "
                "pass dtype= to convert the floating-point tensors"
            )
    return sorted(entries, key=lambda e: (-_RANK[e.dtype], e.name))


def header_bytes(ordered: list[FileEntry], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header for tensors already in :func:`file_order`."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {key: str(metadata[key]) for key in sorted(metadata)}
    offset = 0
    for e in ordered:
        header[e.name] = {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(text)) + text
