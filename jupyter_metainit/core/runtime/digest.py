"""Content digests: has anything written to this memory since we last looked?

PyTorch's version counter misses writes through ``.data``, ``detach()``, numpy views and
``torch.from_numpy`` sharing. ``dematerialize`` must not drop weights someone loaded that way, and
replay must not use a real input that changed, so both compare a digest of every byte.

Cost (measured in ``benchmarks/bench_materialize.py``): CRC-32 over the storage, in chunks on the
process's thread pool (``runtime/pool``; zlib releases the GIL), about 2 GB/s per core on the CPU;
on other devices a position-weighted sum computed on the device. Taken once when a tensor is
materialized with ``keep_cache=True`` and once when it is dematerialized.
"""

from __future__ import annotations

import zlib

import torch

from jupyter_metainit.core.runtime.pool import available_cores, core_pool

__all__ = ["digest"]

_CHUNK = 64 << 20


def _crc(view: memoryview) -> int:
    return zlib.crc32(view)


def digest(t: torch.Tensor) -> tuple[int, ...]:
    """A digest of every byte of the storage ``t`` views (not just of ``t``'s elements)."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return (0,)
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if storage.device.type == "cpu":
        view = memoryview(raw.numpy())
        chunks = [view[i : i + _CHUNK] for i in range(0, nbytes, _CHUNK)]
        if len(chunks) == 1:
            return (nbytes, _crc(chunks[0]))
        workers = min(len(chunks), available_cores())
        if workers <= 1:  # one core, or on a pool thread already: no waiting on the pool
            return (nbytes, *map(_crc, chunks))
        return (nbytes, *core_pool(workers).map(_crc, chunks))
    return (nbytes, *_device_sums(raw))


def _device_sums(raw: torch.Tensor) -> list[int]:
    """Position-weighted sums of 32-bit words, computed where the memory is."""
    words = raw[: raw.numel() // 4 * 4].view(torch.int32)
    sums = []
    step = _CHUNK // 4
    for i in range(0, words.numel(), step):
        part = words[i : i + step].to(torch.int64)
        weights = torch.arange(1, part.numel() + 1, device=raw.device, dtype=torch.int64)
        sums.append(int((part * weights).sum()))
    tail = raw[words.numel() * 4 :]
    sums.append(int(tail.to(torch.int64).sum()) if tail.numel() else 0)
    return sums
