"""``megarl convert``: Hugging Face folders <-> megarl's per-rank Megatron-core layout, streamed.

On-disk Megatron layout (a weights-only checkpoint; ``meta.json`` documents it)::

    OUT/meta.json                               format, HF config.json, tp/pp/ep (vpp), padded vocab, dtype, files,
                                                checksums (below)
    OUT/model_tp{t}_pp{p}_ep{e}.safetensors     rank (t, p, e)'s GPTModel piece: exactly
                                                mcore_sharding.shard_rank(full, args, tp, pp, t, p, ep=, ep_rank=e)
                                                (local names and shapes, vocab padded), so
                                                trainer.model.load_state(build_gpt_model(...), piece) works
    OUT/model_tp{t}_pp{p}_vp{v}_ep{e}.safetensors  with virtual pipeline stages (vpp > 1): model chunk v
                                                of rank (t, p, e), the piece of stage v*pp + p of a
                                                pp*vpp-stage cut (mcore_sharding's docstring)
    OUT/tokenizer*, generation_config.json, ... copied from the HF folder (``meta["hf_files"]``)

Checksums. ``meta["checksums"]`` = ``{"algorithm": "crc32", "pieces": {file: {"__header__": ...,
tensor: ...}}, "files": {hf file: ...}}``, computed as the pieces are written (the bytes are hashed
on their way to disk: no extra read). Every reader of pieces (``mcore_to_hf``, ``load_piece``)
checks each header it opens and each tensor it reads, and the copied HF files when copied: a
flipped byte fails with ``ChecksumMismatch`` naming the file (and tensor). Folders written before
checksums existed have none: they are read unchecked, with one warning saying so.

Names and cuts come from the one mapping (:mod:`megarl.models.mcore_mapping`) and the one layout
(:mod:`megarl.models.mcore_sharding`); this module only decides what to read when.

Streaming. Inputs are read by :class:`~megarl.checkpoint.safetensors_stream.LazyTensors`
(positional reads of just the bytes asked for; no memory map, whose touched pages would stay
resident) and written by :class:`~megarl.checkpoint.safetensors_stream.StreamWriter`, which writes
the header from the known shapes first and then one tensor at a time. So peak memory is about one
tensor, not one output file:

* hf -> mcore, per output piece, per local tensor: read only the HF rows/columns that piece needs
  (``get_slice``: a TP rank of ``o_proj`` reads its columns, of ``q_proj`` its head rows), fuse
  (qkv, gate/up) with the mapping, write, free. Each HF byte of a sharded tensor is read once;
  read more than once: replicated tensors (norms, router: once per TP rank), the dense part of a
  MoE model (once per EP rank, since every EP rank holds a copy), the embedding of a tied model
  with PP > 1 (stage 0 and the last stage's copy), and a tied model's redundant ``lm_head``
  (compared once with the embedding).
* mcore -> hf, per full tensor: read its TP pieces, join (``join_pieces``), split into HF tensors
  (``mcore_tensor_to_hf``), write them to the current HF shard, free. Peak: the TP pieces plus the
  full tensor (2x the largest tensor). Replicated tensors are read on every TP rank and checked
  equal; a tied model's last-stage copy is checked equal to the embedding. The dense copies of EP
  ranks > 0 are not read (nor checked).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megarl.checkpoint.convert_checksums import (META, check_checksums_field, check_meta_digest, copy_checked,
                                                 make_checksums, piece_checksums, seal_meta)
from megarl.checkpoint.safetensors_stream import DTYPES, TAGS, LazyTensors, StreamWriter, nbytes
from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.models.config import ModelArgs
from megarl.models.hf_io import INDEX_FILE, SINGLE_FILE, read_hf_config, safetensors_files
from megarl.utils.fs import atomic_dir

FORMAT = "megarl-mcore"
FORMAT_VERSION = 1
# Non-weight files of a HF folder that travel with the weights (tokenizer, generation settings).
HF_FILE_NAMES = ("generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                 "merges.txt", "chat_template.jinja", "chat_template.json")
HF_FILE_PREFIXES = ("tokenizer",)
_EMB, _OUT = "embedding.word_embeddings.weight", "output_layer.weight"
log = logging.getLogger(__name__)


def piece_file(tp_rank: int, pp_rank: int, ep_rank: int = 0, vp: int | None = None) -> str:
    """File of rank (tp_rank, pp_rank, ep_rank)'s piece; ``vp``: its model chunk (vpp > 1 only)."""
    chunk = "" if vp is None else f"_vp{vp}"
    return f"model_tp{tp_rank}_pp{pp_rank}{chunk}_ep{ep_rank}.safetensors"


def stage_file(tp_rank: int, stage: int, ep_rank: int, pp: int, vpp: int) -> str:
    """File of the piece of pipeline stage ``stage`` (of ``pp * vpp``): pipeline rank ``stage % pp``,
    model chunk ``stage // pp``."""
    return piece_file(tp_rank, stage % pp, ep_rank, vp=stage // pp if vpp > 1 else None)


def piece_files(tp: int, pp: int, ep: int, vpp: int = 1) -> list[tuple[tuple[int, int, int], str]]:
    """Every piece of a checkpoint, in file order: ``((tp_rank, stage, ep_rank), file name)``."""
    return [((t, s, e), stage_file(t, s, e, pp, vpp)) for e in range(ep) for s in range(pp * vpp) for t in range(tp)]


@dataclass
class ConvertReport:
    """What a conversion wrote (the summary line)."""

    tensors: int
    """Tensors written."""
    bytes: int
    """Tensor bytes written (headers excluded)."""
    seconds: float
    """Wall time of the conversion, checks and copies included."""

    def line(self) -> str:
        mb = self.bytes / 2**20
        return (f"converted {self.tensors} tensors, {mb:.1f} MiB in {self.seconds:.2f} s "
                f"({mb / max(self.seconds, 1e-9):.1f} MiB/s)")


# ------------------------------------------------------------------------------------------ helpers


def check_out(out: Path, force: bool, inputs: Path) -> None:
    """Refuse to replace a non-empty ``out`` without ``force``, or to write over the input."""
    if out.resolve() == inputs.resolve():
        raise ValueError(f"--out {out} is the input folder; write the conversion elsewhere")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace it")


def _hf_files(src: Path) -> list[str]:
    return sorted(p.name for p in src.iterdir() if p.is_file() and
                  (p.name in HF_FILE_NAMES or p.name.startswith(HF_FILE_PREFIXES)))


def _single_dtype(dtypes: dict[str, torch.dtype], side: str) -> torch.dtype:
    """The one dtype of all tensors; mixed dtypes are an error naming a tensor of each."""
    by = {}
    for name, dt in dtypes.items():
        by.setdefault(dt, name)
    if len(by) != 1:
        raise ValueError(f"{side} tensors have mixed dtypes (the converter keeps one dtype): "
                         + ", ".join(f"{dt} (e.g. {name})" for dt, name in by.items()))
    return next(iter(by))


def _check_names_shapes(src: LazyTensors, expected: dict[str, tuple[int, ...]], side: str,
                        skip: tuple[str, ...] = ()) -> None:
    """Missing / unexpected / misshaped tensors, reported by the mapping's own check (on meta
    tensors: nothing is read)."""
    fake = {n: torch.empty(src.shape(n), device="meta") for n in src.where if n not in skip}
    mm.check_state_dict(fake, expected, side)


def _check_moe_tp(args: ModelArgs, tp: int) -> None:
    if args.is_moe and tp > 1:  # the trainer's rule (trainer.model._moe_config)
        raise ValueError(f"MoE models need tp=1 (got tp={tp}): megarl's trainer refuses MoE with TP > 1; "
                         f"split the experts with ep instead")


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, file=sys.stderr)


# ------------------------------------------------------------------------------------ hf -> mcore


def _read_piece_tensor(src: LazyTensors, lt: ms.LocalTensor, hf_names: tuple[str, ...], args: ModelArgs,
                       tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of one local tensor, reading only the HF rows/columns it holds."""
    if lt.kind == "replicated" or (tp == 1 and lt.kind != "vocab"):
        return mm.hf_tensors_to_mcore(lt.name, tuple(src.get(n) for n in hf_names), args)
    if lt.kind == "vocab":  # rows of the padded vocab; rows past the real vocab are zero padding
        (name,) = hf_names
        rows = lt.shape[0]
        lo = tp_rank * rows
        got = src.rows(name, min(lo, lt.full_shape[0]), min(lo + rows, lt.full_shape[0]))
        if got.shape[0] == rows:
            return got
        return torch.cat([got, got.new_zeros(rows - got.shape[0], *got.shape[1:])])
    if lt.kind == "row":
        (name,) = hf_names
        cols = lt.full_shape[1] // tp
        return src.cols(name, tp_rank * cols, (tp_rank + 1) * cols)
    if lt.kind == "fc1":  # [gate rows k; up rows k]
        n = lt.full_shape[0] // 2 // tp
        return mm.hf_tensors_to_mcore(lt.name, tuple(src.rows(h, tp_rank * n, (tp_rank + 1) * n)
                                                     for h in hf_names), args)
    # qkv: rank k holds KV-head groups k*kv/t..: its query heads, then its k and v heads
    d, nq, nkv = args.head_dim, args.num_attention_heads // tp, args.num_key_value_heads // tp
    local = dataclasses.replace(args, num_attention_heads=nq, num_key_value_heads=nkv)
    q, k, v = hf_names
    return mm.hf_tensors_to_mcore(lt.name, (src.rows(q, tp_rank * nq * d, (tp_rank + 1) * nq * d),
                                            src.rows(k, tp_rank * nkv * d, (tp_rank + 1) * nkv * d),
                                            src.rows(v, tp_rank * nkv * d, (tp_rank + 1) * nkv * d)), local)


def check_hf_weights(src: LazyTensors, args: ModelArgs) -> torch.dtype:
    """Raise naming the tensor unless the HF files hold exactly ``args``'s tensors (a redundant
    tied ``lm_head`` equal to the embedding is tolerated) in one dtype; return that dtype."""
    extra_lm_head = args.tie_word_embeddings and "lm_head.weight" in src.where
    _check_names_shapes(src, mm.hf_shapes(args), "HF", skip=("lm_head.weight",) if extra_lm_head else ())
    dtype = _single_dtype({n: src.dtype(n) for n in src.where}, "HF")
    if extra_lm_head and not torch.equal(src.get("lm_head.weight"), src.get("model.embed_tokens.weight")):
        raise ValueError("tied model (tie_word_embeddings=True): lm_head.weight is present and differs "
                         "from model.embed_tokens.weight")
    return dtype


def read_hf_piece(hf_dir: str | os.PathLike, args: ModelArgs, tp: int, pp: int, tp_rank: int, pp_rank: int,
                  ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """Rank (tp_rank, pp_rank, ep_rank)'s Megatron piece straight from the HF folder, reading only
    the bytes it holds (what a trainer rank loads at start: no rank materialises the whole model).
    With virtual pipeline stages, ``pp`` is the stage count ``pp * vpp`` and ``pp_rank`` a chunk's
    stage (``ParallelDims.stage``).
    Equal to ``mcore_sharding.shard_rank`` of the full mapped state dict."""
    ms.check_parallel(args, tp, pp, ep)
    _check_moe_tp(args, tp)
    with LazyTensors(safetensors_files(Path(hf_dir))) as src:
        check_hf_weights(src, args)
        names = mm.mcore_to_hf_names(args)
        plan = ms.local_plan(args, tp, pp, pp_rank, ep=ep, ep_rank=ep_rank)
        return {local: _read_piece_tensor(src, lt, names[lt.name], args, tp, tp_rank) for local, lt in plan.items()}


def hf_to_mcore(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1, ep: int = 1,
                force: bool = False, progress: bool = True, vpp: int = 1) -> ConvertReport:
    """Convert the HF folder ``hf_dir`` into the per-rank layout (module docstring) at ``out``;
    ``vpp`` > 1: ``vpp`` model chunks (virtual pipeline stages) per pipeline rank."""
    t0 = time.perf_counter()
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = read_hf_config(hf_dir)
    args = ModelArgs.from_hf_config(cfg)  # unsupported architectures / fields fail here
    ms.check_parallel(args, tp, pp, ep, vpp=vpp)
    if vpp > 1 and pp < 2:
        raise ValueError(f"--vpp {vpp} (virtual pipeline stages) needs --pp >= 2 (got --pp {pp})")
    _check_moe_tp(args, tp)
    check_out(out, force, hf_dir)
    stages = pp * vpp
    with LazyTensors(safetensors_files(hf_dir)) as src:
        dtype = check_hf_weights(src, args)
        names = mm.mcore_to_hf_names(args)
        ranks = piece_files(tp, pp, ep, vpp)
        plans = {(s, e): ms.local_plan(args, tp, stages, s, ep=ep, ep_rank=e) for e in range(ep) for s in range(stages)}
        total = sum(len(plans[(s, e)]) for (t, s, e), _ in ranks)
        n_bytes = 0
        bar = _progress(total, "hf -> mcore", progress)
        sums: dict[str, dict[str, str]] = {}
        with atomic_dir(out) as tmp:
            for (t, s, e), file in ranks:
                plan = plans[(s, e)]
                entries = [(local, lt.shape, dtype) for local, lt in plan.items()]
                with StreamWriter(tmp / file, entries) as w:
                    for local, lt in plan.items():
                        w.write(local, _read_piece_tensor(src, lt, names[lt.name], args, tp, t))
                        bar.update()
                    n_bytes += w.total_bytes
                sums[file] = w.checksums
            hf_files = _hf_files(hf_dir)
            for name in hf_files:
                shutil.copy2(hf_dir / name, tmp / name)
            meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "hf_config": cfg,
                    "tp": tp, "pp": pp, "ep": ep, "vpp": vpp, "vocab_size": args.vocab_size,
                    "padded_vocab_size": ms.padded_vocab(args.vocab_size, tp), "dtype": TAGS[dtype],
                    "files": [file for _, file in ranks], "hf_files": hf_files,
                    "checksums": make_checksums(sums, tmp, hf_files)}
            seal_meta(meta)
            with open(tmp / META, "w") as f:
                json.dump(meta, f, indent=2)
        bar.close()
    return ConvertReport(total, n_bytes, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------ mcore -> hf


def read_meta(ckpt: str | os.PathLike) -> tuple[dict, ModelArgs]:
    """``meta.json`` of a converted checkpoint, checked field by field, and its model args."""
    path = Path(ckpt) / META
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a megarl converted checkpoint: {path} is missing")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is corrupted (not JSON: {exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is corrupted: expected a JSON object")
    check_meta_digest(meta, path)
    fields = {"format": str, "format_version": int, "hf_config": dict, "tp": int, "pp": int, "ep": int,
              "padded_vocab_size": int, "dtype": str, "files": list, "hf_files": list}
    for key, typ in fields.items():
        if not isinstance(meta.get(key), typ):
            raise ValueError(f"{path} is corrupted: field {key!r} is {meta.get(key)!r}, expected a {typ.__name__}")
    if meta["format"] != FORMAT or meta["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta['format']!r} version {meta['format_version']} is not "
                         f"{FORMAT!r} version {FORMAT_VERSION}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"{path}: field 'dtype' is {meta['dtype']!r}; valid: {sorted(DTYPES)}")
    meta.setdefault("vpp", 1)  # written before virtual stages existed: one chunk per rank
    if not isinstance(meta["vpp"], int) or meta["vpp"] < 1:
        raise ValueError(f"{path} is corrupted: field 'vpp' is {meta['vpp']!r}, expected an int >= 1")
    args = ModelArgs.from_hf_config(meta["hf_config"])
    tp, pp, ep, vpp = meta["tp"], meta["pp"], meta["ep"], meta["vpp"]
    ms.check_parallel(args, tp, pp, ep, vpp=vpp)
    if meta["padded_vocab_size"] != ms.padded_vocab(args.vocab_size, tp):
        raise ValueError(f"{path}: field 'padded_vocab_size' is {meta['padded_vocab_size']}, expected "
                         f"{ms.padded_vocab(args.vocab_size, tp)} for vocab_size={args.vocab_size}, tp={tp}")
    want = [file for _, file in piece_files(tp, pp, ep, vpp)]
    if meta["files"] != want:
        raise ValueError(f"{path}: field 'files' is {meta['files']}, expected {want} for tp={tp} pp={pp} ep={ep} "
                         f"vpp={vpp}")
    check_checksums_field(meta, path)
    missing = [f for f in want + meta["hf_files"] if not (Path(ckpt) / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{ckpt}: files listed in {META} are missing: {missing}")
    return meta, args


def _hf_shards(order: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
               max_bytes: int) -> list[list[str]]:
    """HF names cut, in order, into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        b = nbytes(shapes[name], dtype)
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def mcore_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, max_shard_mb: float = 5000,
                force: bool = False, progress: bool = True) -> ConvertReport:
    """Convert a checkpoint written by :func:`hf_to_mcore` (or in its layout) back to a HF folder."""
    t0 = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out)
    meta, args = read_meta(ckpt)
    check_out(out, force, ckpt)
    sums = piece_checksums(ckpt, meta)
    with contextlib.ExitStack() as stack:  # keyed by (tp_rank, stage, ep_rank): stages = pp * vpp
        srcs = {key: stack.enter_context(LazyTensors([ckpt / file], sums))
                for key, file in piece_files(meta["tp"], meta["pp"], meta["ep"], meta["vpp"])}
        return _mcore_to_hf(ckpt, out, meta, args, srcs, max_shard_mb, progress, t0)


def _mcore_to_hf(ckpt: Path, out: Path, meta: dict, args: ModelArgs, srcs: dict, max_shard_mb: float,
                 progress: bool, t0: float) -> ConvertReport:
    tp, ep, vpp, dtype = meta["tp"], meta["ep"], meta["vpp"], DTYPES[meta["dtype"]]
    pp = meta["pp"] * vpp  # pipeline stages: below, p is a stage (pp_rank p % pp, chunk p // pp)
    where: dict[str, tuple[int, int, str, ms.LocalTensor]] = {}  # full name -> (stage, ep, local, plan)
    for (t, p, e), src in srcs.items():
        chunk = f", vp={p // meta['pp']}" if vpp > 1 else ""
        side = f"{stage_file(t, p, e, meta['pp'], vpp)} (tp_rank={t}, pp_rank={p % meta['pp']}{chunk}, ep_rank={e})"
        _check_names_shapes(src, ms.local_shapes(args, tp, pp, t, p, ep=ep, ep_rank=e), side)
        for name in src.where:
            if src.dtype(name) != dtype:
                raise ValueError(f"{side}: tensor {name} has dtype {src.dtype(name)}, {META} says {meta['dtype']}")
        if t == 0:
            for local, lt in ms.local_plan(args, tp, pp, p, ep=ep, ep_rank=e).items():
                if not lt.tied_copy:
                    where.setdefault(lt.name, (p, e, local, lt))  # dense part: EP rank 0's copy
    names = mm.mcore_to_hf_names(args)
    hf_shapes = mm.hf_shapes(args)
    order = [h for mc in names for h in names[mc]]
    shards = _hf_shards(order, hf_shapes, dtype, int(max_shard_mb * 2**20))
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shard_of = {h: i for i, shard in enumerate(shards) for h in shard}
    bar = _progress(len(order), "mcore -> hf", progress)
    with atomic_dir(out) as tmp:
        writers: list[StreamWriter | None] = [None] * len(shards)
        for mc, hf_names in names.items():
            p, e, local, lt = where[mc]
            pieces = [srcs[(t, p, e)].get(local) for t in range(tp)]
            if lt.kind == "replicated":
                for t in range(1, tp):
                    if not torch.equal(pieces[t], pieces[0]):
                        at = f"pp_rank={p}" if vpp == 1 else f"stage {p} (pp_rank={p % meta['pp']}, vp={p // meta['pp']})"
                        raise ValueError(f"replicated tensor {local} of {at} differs between "
                                         f"tp_rank=0 and tp_rank={t}")
            full = ms.join_pieces(pieces, lt.kind, lt.full_shape)
            del pieces
            for h, tensor in mm.mcore_tensor_to_hf(mc, full, args, hf_names).items():
                i = shard_of[h]
                if writers[i] is None:
                    if i > 0:
                        writers[i - 1].close()
                    writers[i] = StreamWriter(tmp / files[i], [(n, hf_shapes[n], dtype) for n in shards[i]],
                                              checksums=False)  # HF folders carry none
                writers[i].write(h, tensor)
                bar.update()
        writers[-1].close()
        if args.tie_word_embeddings and pp > 1:
            _check_tied_copy(srcs, tp, meta["pp"], vpp)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(w.total_bytes for w in writers)},
                     "weight_map": {h: files[shard_of[h]] for h in order}}
            with open(tmp / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump(meta["hf_config"], f, indent=2)
        for name in meta["hf_files"]:
            copy_checked(ckpt / name, tmp / name, meta)
    bar.close()
    return ConvertReport(len(order), sum(w.total_bytes for w in writers), time.perf_counter() - t0)


def _check_tied_copy(srcs: dict, tp: int, pp: int, vpp: int = 1) -> None:
    """The last stage's copy of tied embeddings equals stage 0's, piece by piece."""
    last = pp * vpp - 1
    for t in range(tp):
        if not torch.equal(srcs[(t, last, 0)].get(_OUT), srcs[(t, 0, 0)].get(_EMB)):
            raise ValueError(f"tied embeddings: {_OUT} of {stage_file(t, last, 0, pp, vpp)} differs from "
                             f"{_EMB} of {stage_file(t, 0, 0, pp, vpp)}")


def load_piece(ckpt: str | os.PathLike, tp_rank: int, pp_rank: int, ep_rank: int = 0,
               vp: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's local Megatron state dict from a converted checkpoint (for ``load_state``); with
    virtual stages, of its model chunk ``vp``."""
    meta, _ = read_meta(ckpt)
    if (meta["vpp"] > 1) != (vp is not None) or (vp is not None and not 0 <= vp < meta["vpp"]):
        raise ValueError(f"{ckpt} has vpp={meta['vpp']}: pass vp in 0..{meta['vpp'] - 1}" if meta["vpp"] > 1
                         else f"{ckpt} has no virtual pipeline stages (vpp=1): pass vp=None, got {vp}")
    with LazyTensors([Path(ckpt) / piece_file(tp_rank, pp_rank, ep_rank, vp=vp)], piece_checksums(ckpt, meta)) as src:
        return {n: src.get(n) for n in src.where}
