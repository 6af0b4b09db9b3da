"""Checksums of what megarl writes (converted pieces, RL checkpoints), verified when read back.

Why: a flipped byte in a weight file loads without complaint and silently changes the model
(without them, a corrupted converted piece converted back with exit 0 and 16 wrong elements). A
checksum recorded at write time and compared at read time turns that into one error naming the
file (and, for RL checkpoints, the checkpoint to resume from instead).

Two algorithms, each recorded next to its digests (so another can be added without breaking old
files), chosen by what they guard:

- ``crc32`` (``zlib``, ~6.5 GB/s) for the converter's per-tensor checksums: conversion streams at
  disk speed and every byte is hashed once on write and once on read; SHA-256 (~1.9 GB/s with the
  CPU's SHA extensions, ~0.4 GB/s without) cost a third of the conversion time on a tmpfs, CRC32
  costs a few percent (``benchmarks/bench_convert.py``). The threat is accidental corruption
  (disk, copy, truncation), not forgery: a CRC catches every burst of up to 32 flipped bits and
  any other change but with probability 2**-32, and sizes are checked separately.
- ``sha256`` for RL checkpoint files (one digest per file, ``state.json``): the files are hashed
  once after ``torch.save`` (from the page cache) and once by the process that loads them, a small
  part of writing or reading them, and a user can check them with ``sha256sum``.
"""
from __future__ import annotations

import hashlib
import os
import zlib

PIECES = "crc32"
"""Algorithm of the converter's per-tensor checksums (``meta.json``)."""
FILES = "sha256"
"""Algorithm of RL checkpoints' per-file checksums (``state.json``)."""
_CHUNK = 8 << 20


class ChecksumMismatch(ValueError):
    """A file's (or tensor's) bytes differ from the checksum recorded when it was written."""


def digest(data, algorithm: str = PIECES) -> str:
    """Hex digest of a bytes-like object (a memoryview is not copied)."""
    if algorithm == "crc32":
        return f"{zlib.crc32(data):08x}"
    return hashlib.new(algorithm, data).hexdigest()


def file_digest(path: str | os.PathLike, algorithm: str = FILES) -> tuple[str, int]:
    """Hex digest and size in bytes of a file, read in chunks."""
    with open(path, "rb") as f:
        if algorithm != "crc32":
            h = hashlib.file_digest(f, algorithm)
            return h.hexdigest(), f.tell()
        crc, size, buf = 0, 0, bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
        return f"{crc:08x}", size


def check_algorithm(name, expected: str, where) -> None:
    """Refuse a recorded algorithm this megarl does not read there."""
    if name != expected:
        raise ValueError(f"{where}: checksum algorithm {name!r} is not supported here (valid: {expected!r})")


__all__ = ["FILES", "PIECES", "ChecksumMismatch", "check_algorithm", "digest", "file_digest"]
