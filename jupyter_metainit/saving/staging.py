"""Where a save's files are written until they are final, and how they are put in place.

Use :func:`staging_directory` around the writing and :func:`publish_directory` at its end:
together they make a save that fails or is cancelled leave nothing where the checkpoint should
be, and a save that succeeds touch nothing in the destination but its own files.

The staging directory is a hidden directory *inside* the destination (made first if missing,
with the permissions ``os.makedirs`` gives, as eager ``save_pretrained`` does): the final files
are then on its file system whatever is mounted where (a volume mounted at the destination), and
an existing destination needs no write permission on its parent. Publishing is all or nothing:
the files it replaces and those of an earlier checkpoint that this one makes stale (``stale``)
are moved aside first, then each finished file moved into place (``os.replace``; an index last,
so that a reader never finds an index naming a shard that is not there yet); any failure puts
everything back. The user's other files stay. :func:`refuse_overwriting_sources` refuses,
before anything is written, a save that would replace files its own deferred tensors are still
read from (a model opened with ``from_pretrained`` inside ``meta_init``, saved back into its
directory): they could never be materialized afterwards.

A save holds an exclusive ``flock`` on an ``.owner`` file in its staging directory while it
runs; the kernel drops it however the process ends. The next save into the destination
removes the staging directories whose lock nobody holds (a save killed with SIGKILL, or lost
with its machine): :func:`remove_stale_staging`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import contextmanager

import torch

from jupyter_metainit.core import format_bytes, source_files

try:
    import fcntl
except ImportError:  # Windows: no locks, so no staging directory is ever taken for stale
    fcntl = None  # type: ignore[assignment]
from jupyter_metainit.core.errors import ArgumentError, MetaInitError

__all__ = [
    "checked_destination",
    "disk_full_error",
    "is_dcp_file",
    "no_space_error",
    "publish_directory",
    "refuse_overwriting_sources",
    "remove_stale_staging",
    "staging_directory",
]

STAGING_PREFIX = ".saving-"  # never a checkpoint file's name: stale rules do not match it
_STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + r"([a-z0-9_]{8}|dcp)")  # mkdtemp's names
_OWNER = ".owner"  # in a staging directory: locked by the save that writes it
#: a staging directory without an ``.owner`` is a killed save's once unchanged this long
UNOWNED_STALE_SECONDS = 3600.0


def checked_destination(path: str) -> str:
    """``path`` as the directory a save writes, or a clear error before any work is done."""
    if not path:
        raise ArgumentError("save(path=...) needs a directory to write, not an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"save() writes a directory; {path} is a file")
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is a link to {os.readlink(path)}, which does not exist: make that "
            "directory, or save to another path. Nothing was written."
        )
    return path


@contextmanager
def staging_directory(
    destination: str, *, shared_name: str | None = None, owner: bool = True
) -> Iterator[str]:
    """A new hidden directory inside ``destination`` (made if missing), removed with
    everything in it at the end; the directories this made for ``destination`` are removed too
    if the block fails and they are still empty.

    ``shared_name``: a fixed name instead of a unique one, for processes that write into one
    staging directory (ranks of a ``torch.distributed`` save); only the ``owner`` makes and
    removes it (the others must wait for it, e.g. at a barrier)."""
    made = _first_missing(destination) if owner else None
    staging: str | None = None
    claim: int | None = None
    try:
        if owner:
            os.makedirs(destination, exist_ok=True)
            remove_stale_staging(destination)
        if shared_name is None:
            staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=destination)
        else:
            staging = _shared_staging(destination, shared_name, owner)
        if owner:
            claim = _claim(staging)
    except OSError as exc:  # said about the path the user gave, with what to do
        if owner and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if made is not None:
            _remove_empty_up_to(destination, made)
        if isinstance(exc, _SaveRunning):
            raise
        raise OSError(
            exc.errno,
            f"cannot write to {destination} ({exc.strerror}): choose a directory you can "
            "write to. Nothing was written",
        ) from None
    finished = False
    try:
        yield staging
        finished = True
    finally:
        if owner:
            shutil.rmtree(staging, ignore_errors=True)
            if claim is not None:
                os.close(claim)  # after the removal: never unowned while it exists
            if made is not None and not finished:
                _remove_empty_up_to(destination, made)


class _SaveRunning(FileExistsError):
    """Another save writes into the shared staging directory now."""


def _shared_staging(destination: str, shared_name: str, owner: bool) -> str:
    """The staging directory every rank writes into, made by the owner; refused while
    another save writes it (:func:`remove_stale_staging` removed it if its save is gone)."""
    staging = os.path.join(destination, STAGING_PREFIX + shared_name)
    if owner:
        try:
            os.mkdir(staging)
        except FileExistsError:
            raise _SaveRunning(
                errno.EEXIST,
                f"another save is writing into {destination} now (its {STAGING_PREFIX}"
                f"{shared_name} is there): wait for it to end, or save elsewhere. Nothing was "
                "written",
            ) from None
    return staging


def _claim(staging: str) -> int | None:
    """Mark ``staging`` as this save's while it runs: an ``.owner`` file this process holds
    an exclusive ``flock`` on (released by the kernel however the process ends, SIGKILL
    included). Made under another name and renamed once locked, so that a ``.owner`` file
    is never seen unlocked while its save lives. Returns the descriptor to close at the end
    (None where the file system has no locks: then it stays unclaimed and is never removed
    as stale while it has an ``.owner``)."""
    making = os.path.join(staging, _OWNER + "-new")
    fd: int | None = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if fcntl is None:
            raise OSError(errno.ENOLCK, "no locks")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no locks on this file system: unclaimed
        os.close(fd)
        fd = None
    os.replace(making, os.path.join(staging, _OWNER))
    return fd


def remove_stale_staging(destination: str) -> list[str]:
    """Remove the staging directories of saves into ``destination`` that no process runs any
    more (killed, SIGKILL included, or lost with their machine), with everything in them.
    Only ours (``.saving-`` and the name ``mkdtemp`` gives), and only where nobody holds the
    lock of its ``.owner`` file; one without an ``.owner`` (a save killed as it began, or a
    version that made none) once it has not changed for ``UNOWNED_STALE_SECONDS`` and if it
    holds only files, as a save's does. Never
    fails: what cannot be told or removed stays. Returns the names removed."""
    try:
        names = [n for n in os.listdir(destination) if _STAGING_NAME.fullmatch(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(destination, name)
        with contextlib.suppress(OSError):
            if _remove_if_stale(path):
                removed.append(name)
    return removed


def _remove_if_stale(path: str) -> bool:
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        fd = os.open(os.path.join(path, _OWNER), os.O_RDONLY)
    except FileNotFoundError:
        if time.time() - os.stat(path).st_mtime < UNOWNED_STALE_SECONDS:
            return False  # maybe a save that is making it now
        if not all(
            e.is_file(follow_symlinks=False) or e.name == ".replaced" for e in os.scandir(path)
        ):
            return False  # not what a save writes: not ours
        shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        if fcntl is None:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live save: BlockingIOError
        shutil.rmtree(path, ignore_errors=True)  # under the lock: a third save waits for it
        return True
    finally:
        os.close(fd)


def publish_directory(staging: str, destination: str, stale: Callable[[str], bool]) -> None:
    """Put every file of ``staging`` in ``destination`` (same file system, see the module's
    docstring) in place of the files there it replaces and of those ``stale`` names (an earlier
    checkpoint's shards, or its single file where this one is sharded), all or nothing: the old
    files are moved aside first, then the new ones in, indexes last; a failure (a file that
    cannot be moved, Ctrl-C) puts everything back as it was before it raises."""
    new = sorted(
        (n for n in os.listdir(staging) if n != _OWNER), key=lambda name: (is_index(name), name)
    )
    in_the_way = [n for n in new if os.path.isdir(os.path.join(destination, n))]
    if in_the_way:  # before anything moves: a half-replaced checkpoint is worse than none
        raise IsADirectoryError(
            f"{destination} holds a directory named {in_the_way[0]!r} where the checkpoint's "
            "file goes; move or rename it, or save to another directory. Nothing was replaced."
        )
    written = set(new)
    old = [n for n in new if os.path.lexists(os.path.join(destination, n))] + [
        n
        for n in sorted(os.listdir(destination))
        if n not in written and stale(n) and os.path.isfile(os.path.join(destination, n))
    ]
    aside = os.path.join(staging, ".replaced")
    os.mkdir(aside)
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        for name in old:
            _move(destination, aside, name, destination)
            moved_aside.append(name)
        for name in new:
            _move(staging, destination, name, destination)
            moved_in.append(name)
    except BaseException:
        for name in reversed(moved_in):
            with contextlib.suppress(OSError):
                os.replace(os.path.join(destination, name), os.path.join(staging, name))
        for name in reversed(moved_aside):
            with contextlib.suppress(OSError):
                os.replace(os.path.join(aside, name), os.path.join(destination, name))
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _move(source: str, target: str, name: str, destination: str) -> None:
    """``os.replace`` of one file, its error said about the user's directory, not ours."""
    try:
        os.replace(os.path.join(source, name), os.path.join(target, name))
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"could not replace {name} in {destination} ({exc.strerror}); the files there "
            "were left as they were",
        ) from None


def refuse_overwriting_sources(
    tensors: Iterable[torch.Tensor] | dict[str, torch.Tensor],
    destination: str,
    *,
    written: Container[str],
    stale: Callable[[str], bool],
) -> None:
    """Raise if a deferred tensor among ``tensors`` reads a file of ``destination`` that the
    save would replace (a name in ``written``) or remove (one ``stale`` names)."""
    if not os.path.isdir(destination):
        return
    replaced = {
        os.path.realpath(os.path.join(destination, name))
        for name in os.listdir(destination)
        if name in written or stale(name)
    }
    if not replaced:
        return
    values = tensors.values() if isinstance(tensors, dict) else tensors
    needed: dict[str, int] = {}
    for t in values:
        for path in source_files(t):
            if os.path.realpath(path) in replaced:
                needed[path] = needed.get(path, 0) + 1
    if needed:
        files = ", ".join(os.path.basename(p) for p in sorted(needed))
        count = sum(needed.values())
        raise MetaInitError(
            f"{count} deferred tensor(s) being saved are still read from {files} in "
            f"{destination}, which this save would replace: they could not be materialized "
            "afterwards. Materialize them first (jupyter_metainit.materialize(model)), or save "
            "to another directory. Nothing was written."
        )


def is_index(name: str) -> bool:
    """A file that names the others: transformers' shard index, a DCP checkpoint's metadata."""
    return name.endswith(".index.json") or name == ".metadata"


def is_dcp_file(name: str) -> bool:
    """A file of a DCP checkpoint: what a DCP save there replaces or removes."""
    return name == ".metadata" or name.endswith(".distcp")


def no_space_error(destination: str, needed: int) -> OSError:
    """What a save that ran out of room on the device of ``destination`` says: what it
    needed, what is free there (on the directory that holds it, if it is gone again)."""
    try:
        free = f", {format_bytes(shutil.disk_usage(_existing_ancestor(destination)).free)} free"
    except OSError:
        free = ""
    return OSError(
        errno.ENOSPC,
        f"no space left on the device of {destination} for the checkpoint ({format_bytes(needed)} "
        f"of tensors{free}): free some space or save elsewhere. Nothing was saved",
    )


def disk_full_error(destination: str, needed: int) -> OSError | None:
    """:func:`no_space_error` when a failure did not say why but the device lacks the room
    (torch's DCP writer says "enforce fail ... unexpected pos"), else None."""
    try:
        free = shutil.disk_usage(_existing_ancestor(destination)).free
    except OSError:
        return None
    return no_space_error(destination, needed) if free < needed else None


def _existing_ancestor(path: str) -> str:
    """``path`` if it is a directory, else the nearest directory above it."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _first_missing(path: str) -> str | None:
    """The outermost directory of ``path`` that does not exist yet (what ``makedirs`` makes)."""
    path = os.path.abspath(path)
    existing = _existing_ancestor(path)
    if existing == path:
        return None
    relative = os.path.relpath(path, existing).split(os.sep)
    return os.path.join(existing, relative[0])


def _remove_empty_up_to(directory: str, top: str) -> None:
    """Remove ``directory`` and its parents up to ``top`` while they are empty."""
    path = os.path.abspath(directory)
    while True:
        try:
            os.rmdir(path)
        except OSError:  # not empty (or gone): leave it and what holds it
            return
        if path == top or len(path) <= len(top):
            return
        path = os.path.dirname(path)
