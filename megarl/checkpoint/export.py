"""The run's final Hugging Face export, through the converter: no process holds the whole model.

Every process calls :func:`export_hf`. The first replica of each trainer piece writes its local
Megatron state dict (one per model chunk with virtual pipeline stages) as
``model_tp<t>_pp<p>[_vp<v>]_ep<e>.safetensors`` into a staging folder beside the
output, and rank 0 adds ``meta.json``, the generation config and the tokenizer: together the
converter's per-rank layout (``megarl/checkpoint/convert.py``). Rank 0 then runs
:func:`~megarl.checkpoint.convert.mcore_to_hf` on it, which streams one tensor at a time (and
checks that replicated pieces agree and a tied model's copies are equal) into the HF folder,
renamed into place when complete; the staging folder is removed.

Pieces are written with ``StreamWriter``, which hashes them on the way to disk; each writer leaves
its checksums beside its piece (``<piece>.checksums.json``) and rank 0 gathers them into
``meta.json``, so the converter checks every tensor it reads back like any converted folder.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from megarl.checkpoint import convert
from megarl.checkpoint.convert_checksums import seal_meta
from megarl.checkpoint.safetensors_stream import TAGS, StreamWriter

_SUMS = ".checksums.json"
from megarl.models import mcore_sharding


def _first_replica(dims) -> bool:
    """Whether this process writes its piece: data-parallel replicas hold equal pieces (for MoE,
    the expert-data-parallel ones: ranks of other EP ranks hold other experts)."""
    group = dims.expt_dp_group if dims.ep > 1 else dims.dp_group
    return group is None or dist.get_world_size(group) == 1 or dist.get_rank(group) == 0


def export_hf(trainer, out_dir: str | Path, write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write the trainer's weights as a HF folder at ``out_dir`` (collective: every trainer process
    calls it; rank 0 writes). ``write_extra(folder)`` adds files such as the tokenizer."""
    dims, args, out_dir = trainer.dims, trainer.args, Path(out_dir)
    stage = out_dir.with_name(f".{out_dir.name}.pieces")
    group = dims.trainer_group  # the trainer processes (None: all of them)
    multi = dist.is_initialized() and dist.get_world_size(group) > 1
    if dims.rank == 0:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    if multi:
        dist.barrier(group=group)
    if _first_replica(dims):
        for s, piece in trainer.local_pieces().items():  # one per model chunk
            _write_piece(stage / convert.stage_file(dims.tp_rank, s, dims.ep_rank, dims.pp, dims.vpp), piece)
    if multi:
        dist.barrier(group=group)
    try:
        if dims.rank == 0:
            dtype = trainer.dtype
            gen = {k: getattr(args, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if getattr(args, k) is not None}
            with open(stage / "generation_config.json", "w") as f:
                json.dump({**gen, "do_sample": False}, f, indent=2)
            before = set(p.name for p in stage.iterdir())  # pieces and their checksum files
            if write_extra is not None:
                write_extra(stage)
            hf_files = ["generation_config.json", *sorted(p.name for p in stage.iterdir() if p.name not in before)]
            files = [f for _, f in convert.piece_files(dims.tp, dims.pp, dims.ep, dims.vpp)]
            sums = {f: json.loads((stage / (f + _SUMS)).read_text()) for f in files}
            meta = {"format": convert.FORMAT, "format_version": convert.FORMAT_VERSION,
                    "hf_config": args.to_hf_config(torch_dtype=str(dtype).removeprefix("torch.")),
                    "tp": dims.tp, "pp": dims.pp, "ep": dims.ep, "vpp": dims.vpp, "vocab_size": args.vocab_size,
                    "padded_vocab_size": mcore_sharding.padded_vocab(args.vocab_size, dims.tp),
                    "dtype": TAGS[dtype], "files": files, "hf_files": hf_files,
                    "checksums": convert.make_checksums(sums, stage, hf_files)}
            seal_meta(meta)
            with open(stage / convert.META, "w") as f:
                json.dump(meta, f, indent=2)
            convert.mcore_to_hf(stage, out_dir, force=True, progress=False)
    finally:
        if dims.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
    if multi:
        dist.barrier(group=group)
    return out_dir


def _write_piece(path: Path, piece: dict) -> None:
    """One local state dict as a safetensors file, its checksums beside it (``<file>.checksums.json``)."""
    local = {k: v.detach().contiguous().cpu() for k, v in piece.items()}
    with StreamWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in local.items()]) as w:
        for k, v in local.items():
            w.write(k, v)
    path.with_name(path.name + _SUMS).write_text(json.dumps(w.checksums))
