"""Safetensors files written one tensor at a time, and a lazy multi-file reader.

``safetensors.torch.save_file`` needs the whole dict in memory. A safetensors file is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, byte range) and the raw bytes in
header order, so once every name, shape and dtype is known up front (the converter knows them from
the model config) the header can be written first and the tensors streamed after it: peak memory
is one tensor, whatever the file size. The result is a plain safetensors file
(``safe_open`` / ``load_file`` / ``transformers`` read it).

Checksums: the writer hashes the header and each tensor's bytes as it writes them
(``StreamWriter.checksums``: ``{"__header__": ..., name: ...}``); given those, the reader checks the
header on open and each tensor on ``get`` (no extra read: the bytes just read are hashed), so a
flipped byte is an error naming the file and tensor instead of a wrong weight. Partial reads
(``rows``/``cols``, used on HF inputs, which carry no checksums) cannot be checked.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from megarl.checkpoint import checksum

# safetensors dtype tags <-> torch dtypes (the ones checkpoints use).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
TAGS = {v: k for k, v in DTYPES.items()}
HEADER = "__header__"
"""Key of the header's checksum (the 8-byte length and the JSON) among a file's tensor checksums."""


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class StreamWriter:
    """Writes a safetensors file whose tensors (``(name, shape, dtype)`` in file order) are given
    up front, then passed one at a time to :meth:`write` in that order. :meth:`close` fails unless
    every tensor was written. ``checksums``: hash header and tensors (``self.checksums``)."""

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None, checksums: bool = True):
        self.path, self.entries, self._next = Path(path), list(entries), 0
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, shape, dtype in self.entries:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        self.total_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data start to 8 bytes
        head = struct.pack("<Q", len(raw)) + raw
        self._hash = checksums
        self.checksums: dict[str, str] = {HEADER: checksum.digest(head)} if checksums else {}
        """Checksum (``checksum.PIECES``) of the header and of each tensor written so far."""
        self._f = open(self.path, "wb")
        self._f.write(head)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path.name}: tensor {name} written after the last planned tensor")
        want, shape, dtype = self.entries[self._next]
        if name != want:
            raise ValueError(f"{self.path.name}: tensor {name} written where {want} was planned")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{self.path.name}: tensor {name} has shape {tuple(tensor.shape)} and dtype "
                             f"{tensor.dtype}, planned {tuple(shape)} {dtype}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().data if flat.numel() else b""
        if self._hash:
            self.checksums[name] = checksum.digest(data)
        if flat.numel():
            self._f.write(data)
        self._next += 1

    def close(self) -> None:
        self._f.close()
        if self._next != len(self.entries):
            raise ValueError(f"{self.path.name}: only {self._next} of {len(self.entries)} tensors written "
                             f"(next: {self.entries[self._next][0]})")

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


class LazyTensors:
    """Every tensor of a set of safetensors files by name, read only when asked for, with plain
    positional reads (``os.preadv``) of just the bytes asked for. Not ``safe_open``: its memory map
    keeps every page a conversion touches resident in the process (RSS grows to the input size).
    Headers are checked on open (a truncated or corrupted file fails naming it).

    ``checksums`` ({file name: ``StreamWriter.checksums``}): files listed there have their header
    checked on open and each tensor on ``get`` (``checksum.ChecksumMismatch`` naming file and
    tensor); a tensor or file not listed is read unchecked."""

    def __init__(self, files: list[Path], checksums: dict[str, dict[str, str]] | None = None):
        self._fds: list[int] = []
        self._info: dict[str, tuple[int, torch.dtype, tuple[int, ...], int]] = {}  # fd index, dtype, shape, offset
        self.where: dict[str, Path] = {}
        self._sums: dict[str, str] = {}  # tensor name -> recorded checksum
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            self._fds.append(fd)
            self._read_header(Path(f), len(self._fds) - 1, (checksums or {}).get(Path(f).name))

    def _read_header(self, f: Path, i: int, sums: dict[str, str] | None) -> None:
        fd, size = self._fds[i], os.fstat(self._fds[i]).st_size
        try:
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if 8 + n > size:
                raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
            raw = os.pread(fd, n, 8)
            if sums is not None and checksum.digest(os.pread(fd, 8, 0) + raw) != sums.get(HEADER):
                raise checksum.ChecksumMismatch(f"{f}: its header does not match the {checksum.PIECES} checksum "
                                                f"recorded when it was written: the file is corrupted")
            header = json.loads(raw)
        except checksum.ChecksumMismatch:
            raise
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{f} is not a readable safetensors file: {exc}") from None
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if name in self.where:
                raise ValueError(f"tensor {name} is in two files: {self.where[name].name} and {f.name}")
            if e.get("dtype") not in DTYPES:
                raise ValueError(f"{f.name}: tensor {name} has dtype {e.get('dtype')}, which the converter "
                                 f"does not handle (valid: {sorted(DTYPES)})")
            dtype, shape, (lo, hi) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            if hi - lo != nbytes(shape, dtype) or 8 + n + hi > size:
                raise ValueError(f"{f.name}: tensor {name} has byte range {lo}..{hi} that does not fit its "
                                 f"shape {shape} {dtype} or the file ({size} bytes): truncated or corrupted")
            self._info[name] = (i, dtype, shape, 8 + n + lo)
            self.where[name] = f
            if sums is not None and name in sums:
                self._sums[name] = sums[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name][1]

    def _read(self, name: str, start: int, count: int, verify: bool = False) -> torch.Tensor:
        """``count`` bytes of ``name`` from byte ``start`` of its data, as a flat tensor of its dtype;
        ``verify``: the bytes are the whole tensor, compare them with its recorded checksum."""
        i, dtype, _, offset = self._info[name]
        buf = bytearray(count)
        view, done = memoryview(buf), 0
        while done < count:  # preadv may return less than asked (Linux: at most ~2 GiB per call)
            got = os.preadv(self._fds[i], [view[done:]], offset + start + done)
            if got == 0:
                raise ValueError(f"{self.where[name]}: unexpected end of file reading tensor {name}")
            done += got
        if verify and name in self._sums and checksum.digest(view) != self._sums[name]:
            raise checksum.ChecksumMismatch(
                f"{self.where[name]}: tensor {name} does not match the {checksum.PIECES} checksum recorded "
                f"when the file was written: the file is corrupted")
        if not count:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype)

    def get(self, name: str) -> torch.Tensor:
        _, dtype, shape, _ = self._info[name]
        return self._read(name, 0, nbytes(shape, dtype), verify=True).view(shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) only: the rest of the tensor is not read."""
        _, dtype, shape, _ = self._info[name]
        row = nbytes(shape[1:], dtype)
        return self._read(name, start * row, (stop - start) * row).view(stop - start, *shape[1:])

    def cols(self, name: str, start: int, stop: int, block_bytes: int = 64 * 2**20) -> torch.Tensor:
        """Columns ``start:stop`` of a 2-D tensor, read in blocks of rows of about ``block_bytes`` (so
        the extra memory is one block, not the whole tensor)."""
        _, dtype, (n_rows, n_cols), _ = self._info[name]
        out = torch.empty(n_rows, stop - start, dtype=dtype)
        step = max(1, block_bytes // max(1, nbytes((n_cols,), dtype)))
        for r in range(0, n_rows, step):
            out[r:r + step] = self.rows(name, r, min(r + step, n_rows))[:, start:stop]
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "LazyTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
