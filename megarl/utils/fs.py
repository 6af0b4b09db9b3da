"""Atomic writes: everything megarl writes (checkpoints, exports) appears whole or not at all."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success rename it to ``final`` (replacing an
    older one), on error delete it. The rename is atomic on one filesystem."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700; give it a normal folder's mode
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; restore at once
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary sibling of ``path`` and rename it over ``path``; on any error
    the temporary file is removed, so ``path`` is either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes it 0600; give it a normal file's mode
        with naming_path(path), os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def naming_path(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` of writing ``path`` that names no file (``os.write`` on a
    descriptor, a file object's ``write``/``flush``) as the same error naming ``path``: the CLI's
    one-line message then says which file a full disk stopped."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


# Full disks. Python's own file writes raise OSError(ENOSPC), which the CLI turns into one line
# naming the file and the last good checkpoint; two libraries do not (measured on a full tmpfs):
# ``torch.save(obj, path)`` (its C++ writer) raises RuntimeError("... unexpected pos ...") and
# safetensors' ``save_file`` a SafetensorError("... No space left on device (os error 28)").


def torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` through a Python file object: a full disk is then ``OSError(ENOSPC)`` with
    ``path`` as its file name (same bytes as ``torch.save(obj, path)``)."""
    import torch

    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except Exception as e:  # noqa: BLE001 - only an OSError (maybe under torch's RuntimeError) is rewritten
        # torch's zip writer meets the OSError of a write, then raises a RuntimeError of its own
        # while closing the archive: the OSError is that one's context.
        err, depth = e, 0
        while err is not None and not isinstance(err, OSError) and depth < 8:
            err, depth = err.__cause__ or err.__context__, depth + 1
        if not isinstance(err, OSError) or err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, os.fspath(path)) from e  # a file object's write names no file


@contextlib.contextmanager
def safetensors_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise safetensors' I/O failure while writing ``path`` as the ``OSError`` it wraps
    (``os error N`` in its message), so a full disk reads as one."""
    import re

    try:
        yield
    except Exception as e:  # noqa: BLE001 - only SafetensorError's "(os error N)" is rewritten
        m = re.search(r"\(os error (\d+)\)", str(e))
        if type(e).__name__ != "SafetensorError" or m is None:
            raise
        raise OSError(int(m.group(1)), os.strerror(int(m.group(1))), os.fspath(path)) from e
