"""Checksums of a converted folder (megarl/checkpoint/convert.py): per-tensor CRC32s of every piece
and of the HF files copied along, recorded in ``meta.json`` and checked on every read
(megarl/checkpoint/checksum.py says why CRC32 here); and ``meta.json``'s own SHA-256
(``checksums.meta``), since its ``hf_config`` becomes the converted model's config.json: a changed
character of ``rope_theta`` there converted back with exit 0 into a different model."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from megarl.checkpoint import checksum
from megarl.checkpoint.checksum import ChecksumMismatch

log = logging.getLogger(__name__)
META = "meta.json"


def make_checksums(pieces: dict[str, dict[str, str]], folder: Path, hf_files: list[str]) -> dict:
    """``meta["checksums"]`` from the pieces' ``StreamWriter.checksums`` and the HF files in ``folder``."""
    return {"algorithm": checksum.PIECES, "pieces": pieces,
            "files": {name: checksum.file_digest(folder / name, checksum.PIECES)[0] for name in hf_files}}


def _meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta``'s canonical JSON without ``checksums.meta`` (the digest itself)."""
    rest = {**meta, "checksums": {k: v for k, v in meta["checksums"].items() if k != "meta"}}
    return checksum.digest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode(), checksum.FILES)


def seal_meta(meta: dict) -> dict:
    """``meta`` (with its ``checksums``) with ``checksums.meta`` set: for the writers, last."""
    meta["checksums"]["meta"] = _meta_digest(meta)
    return meta


def check_meta_digest(meta: dict, path: Path) -> None:
    """Refuse a ``meta.json`` whose content changed since it was written (call it on the content as
    read, before anything fills in defaults). Folders converted before it had a checksum of its
    own are read with one warning; the ``checksums`` field's form is checked separately."""
    sums = meta.get("checksums")
    if not isinstance(sums, dict):
        return
    if "meta" not in sums:
        key = str(path.resolve())
        if key not in _warned_unchecked:
            _warned_unchecked.add(key)
            log.warning("%s has no checksum of its own (converted by an older megarl): its fields are read "
                        "unverified; convert again to add it", path)
        return
    if sums["meta"] != _meta_digest(meta):
        raise ChecksumMismatch(f"{path} does not match its own checksum (checksums.meta): the file was changed "
                               f"after it was written; convert the model again")


def check_checksums_field(meta: dict, path: Path) -> None:
    sums = meta.get("checksums")
    if sums is None:
        return
    ok = (isinstance(sums, dict) and isinstance(sums.get("pieces"), dict) and isinstance(sums.get("files"), dict)
          and all(isinstance(v, dict) and all(isinstance(x, str) for x in v.values()) for v in sums["pieces"].values())
          and all(isinstance(v, str) for v in sums["files"].values()))
    if not ok:
        raise ValueError(f"{path} is corrupted: field 'checksums' is not {{'algorithm', 'pieces': {{file: "
                         f"{{tensor: digest}}}}, 'files': {{file: digest}}}}")
    checksum.check_algorithm(sums.get("algorithm"), checksum.PIECES, path)
    missing = [f for f in meta["files"] if f not in sums["pieces"]] + [f for f in meta["hf_files"]
                                                                      if f not in sums["files"]]
    if missing:
        raise ValueError(f"{path} is corrupted: field 'checksums' has no entry for {missing}")


_warned_unchecked: set[str] = set()


def piece_checksums(ckpt: str | os.PathLike, meta: dict) -> dict[str, dict[str, str]] | None:
    """The per-piece checksums to hand ``LazyTensors``; None (and one warning per folder) for a
    folder converted before megarl recorded checksums."""
    sums = meta.get("checksums")
    if sums is None:
        key = str(Path(ckpt).resolve())
        if key not in _warned_unchecked:
            _warned_unchecked.add(key)
            log.warning("%s has no checksums in %s (converted by an older megarl): its pieces are read unverified; "
                        "convert again to add them", ckpt, META)
        return None
    return sums["pieces"]


def copy_checked(src: Path, dst: Path, meta: dict) -> None:
    """Copy an HF file listed in ``meta["hf_files"]``, checking its recorded checksum."""
    shutil.copy2(src, dst)
    want = (meta.get("checksums") or {}).get("files", {}).get(src.name)
    if want is not None and checksum.file_digest(dst, checksum.PIECES)[0] != want:
        raise ChecksumMismatch(f"{src} does not match the {checksum.PIECES} checksum in {src.parent / META}: "
                               f"the file is corrupted")
