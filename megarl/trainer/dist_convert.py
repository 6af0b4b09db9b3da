"""``megarl convert hf-to-torch-dist`` / ``torch-dist-to-hf``: HF folders <-> Megatron-core
distributed checkpoints (``dist_checkpointing``, ``torch_dist`` backend), the format Megatron-LM
reads and writes and that runs with ``trainer.checkpoint_format: torch_dist`` checkpoint in
(megarl/trainer/dist_ckpt.py).

HF -> torch_dist: in one process, the HF weights are loaded into a TP=1, PP=1 Megatron GPTModel
(megarl's layer spec, in the HF weights' dtype) whose ``sharded_state_dict()`` is saved under
``model``, the key Megatron-LM loads: every tensor with its global shape, so the folder loads into
any TP/PP layout (Megatron reshards on load; the vocabulary rows are not padded, and Megatron's
loaders accept another padding). The common state's ``megarl`` entry records the HF
``config.json``; the HF folder's ``config.json``, tokenizer and generation files are copied beside
the checkpoint files (Megatron ignores files it does not name).

torch_dist -> HF: the ``model`` weights of such a folder, or of a run's trainer checkpoint
(``RUN/checkpoints/step_N/trainer``), written in any layout, are loaded into a TP=1 GPTModel in
the checkpoint's dtype and written as a HF folder. The model's HF config comes from the
checkpoint (``megarl`` entry, or a ``config.json`` beside it) or from ``--hf-config``.

Memory: the whole model once in its dtype, plus one tensor, in one process: unlike
``hf-to-mcore`` the conversion is not streamed. Both directions write atomically (temporary folder
renamed into place, docs/design.md §5).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megarl.checkpoint.convert import HF_FILE_NAMES, HF_FILE_PREFIXES, check_out, read_hf_piece
from megarl.models import mcore_mapping
from megarl.models.config import ModelArgs
from megarl.models.hf_io import read_hf_config, safetensors_files, save_hf_model
from megarl.parallel.dist import ParallelDims, init_parallel, teardown
from megarl.trainer.model import build_gpt_model, load_state
from megarl.utils.fs import atomic_dir

FORMAT = "megarl-torch-dist"
MEGARL_KEY = "megarl"  # (dist_ckpt's: a run's trainer checkpoint records its HF config there too)
DIRECTIONS = ("hf-to-torch-dist", "torch-dist-to-hf")


def is_torch_dist(folder: str | Path) -> bool:
    """Whether ``folder`` is a Megatron-core distributed checkpoint (Megatron's ``metadata.json``)."""
    return (Path(folder) / "metadata.json").is_file()


def _one_process(dims: ParallelDims | None):
    """``dims`` when given (it must be a TP=1 PP=1 world of one), else a fresh world of one."""
    if dims is None:
        return init_parallel(), True
    if dims.world_size != 1 or dims.tp != 1 or dims.pp != 1 or dims.ep != 1:
        raise ValueError(f"the torch_dist conversion runs in one process at TP=PP=EP=1; got world_size="
                         f"{dims.world_size}, tp={dims.tp}, pp={dims.pp}, ep={dims.ep}")
    return dims, False


def hf_to_torch_dist(hf_dir: str | Path, out: str | Path, force: bool = False,
                     dims: ParallelDims | None = None) -> Path:
    """Write the HF folder ``hf_dir`` as a torch_dist checkpoint folder ``out`` (module docstring)."""
    from megatron.core import dist_checkpointing
    from megarl.checkpoint.convert import check_hf_weights
    from megarl.checkpoint.safetensors_stream import LazyTensors

    hf_dir, out = Path(hf_dir), Path(out)
    check_out(out, force, hf_dir)
    hf_config = read_hf_config(hf_dir)
    args = ModelArgs.from_hf_config(hf_config)
    with LazyTensors(safetensors_files(hf_dir)) as src:
        dtype = check_hf_weights(src, args)  # names, shapes, one dtype: before anything is written
    dims, owned = _one_process(dims)
    try:
        model = build_gpt_model(args, dims, dtype)
        load_state(model, read_hf_piece(hf_dir, args, 1, 1, 0, 0))
        with atomic_dir(out) as tmp:  # (check_out: out is empty, or --force replaces it)
            common = {"format": FORMAT, "hf_config": hf_config, "dtype": str(dtype).removeprefix("torch.")}
            dist_checkpointing.save({"model": model.sharded_state_dict(), MEGARL_KEY: common}, str(tmp),
                                    sharded_strategy=("torch_dist", 1))
            for name in ["config.json", *_side_files(hf_dir)]:
                shutil.copy2(hf_dir / name, tmp / name)
    finally:
        if owned:
            teardown(dims)
    return out


def _side_files(folder: Path) -> list[str]:
    """The tokenizer and generation files of a model folder (those ``hf-to-mcore`` copies too)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "config.json" and
                  (p.name in HF_FILE_NAMES or p.name.startswith(HF_FILE_PREFIXES)))


def checkpoint_hf_config(ckpt: str | Path, hf_config: str | Path | None = None) -> dict:
    """The HF config of the model in torch_dist folder ``ckpt``: ``hf_config``'s ``config.json``
    when given, else the one the checkpoint records, else a ``config.json`` beside its files."""
    from megatron.core import dist_checkpointing

    ckpt = Path(ckpt)
    if not is_torch_dist(ckpt):
        raise FileNotFoundError(f"{ckpt} is not a Megatron distributed checkpoint (no metadata.json); expected a "
                                f"folder written by `megarl convert hf-to-torch-dist` or a run's checkpoints/"
                                f"step_N/trainer with trainer.checkpoint_format=torch_dist")
    if hf_config is not None:
        return read_hf_config(hf_config)
    recorded = dist_checkpointing.load_common_state_dict(str(ckpt)).get(MEGARL_KEY) or {}
    if recorded.get("hf_config"):
        return recorded["hf_config"]
    if (ckpt / "config.json").is_file():
        return read_hf_config(ckpt)
    raise ValueError(f"{ckpt} records no HF config of its model: pass --hf-config with the model's HF folder (a "
                     f"run's: RUN_DIR/hf, or its model.init_from_hf)")


def _checkpoint_dtype(ckpt: Path) -> torch.dtype:
    """The dtype of the checkpoint's model weights (the word embedding's)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    for key in ("embedding.word_embeddings.weight", "model.embedding.word_embeddings.weight"):
        if key in meta:
            return meta[key].dtype
    raise ValueError(f"{ckpt} holds no embedding.word_embeddings.weight: not a GPT model checkpoint")


def load_model_weights(model, ckpt: str | Path) -> None:
    """Load the ``model`` weights of torch_dist folder ``ckpt`` (any layout wrote them) into this
    rank's GPTModel piece ``model`` (any layout), through Megatron-core's ``dist_checkpointing.load``
    (which casts to the model's dtype). Collective over every process of the default group."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    model.load_state_dict(loaded["model"], strict=True)


def load_torch_dist_model(ckpt: str | Path, args: ModelArgs, dims: ParallelDims, dtype: torch.dtype):
    """A GPTModel of ``dims``' layout in ``dtype`` with the ``model`` weights of ``ckpt``. Collective."""
    model = build_gpt_model(args, dims, dtype)
    load_model_weights(model, ckpt)
    return model


def torch_dist_to_hf(ckpt: str | Path, out: str | Path, hf_config: str | Path | None = None, force: bool = False,
                     dims: ParallelDims | None = None) -> Path:
    """Write the model weights of torch_dist folder ``ckpt`` as a HF folder ``out`` (module docstring)."""
    ckpt, out = Path(ckpt), Path(out)
    check_out(out, force, ckpt)
    config = checkpoint_hf_config(ckpt, hf_config)
    args = ModelArgs.from_hf_config(config)
    dtype = _checkpoint_dtype(ckpt)
    side = Path(hf_config) if hf_config is not None else ckpt
    dims, owned = _one_process(dims)
    try:
        model = load_torch_dist_model(ckpt, args, dims, dtype)
        sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        hf = mcore_mapping.mcore_to_hf(sd, args)
    finally:
        if owned:
            teardown(dims)

    def write_extra(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))  # the model's own, not a rebuilt one
        for name in _side_files(side):
            shutil.copy2(side / name, tmp / name)

    return save_hf_model(hf, args, out, write_extra)  # atomic; replaces out (check_out: empty, or --force)


def run_dist_convert(args) -> None:
    """``megarl convert hf-to-torch-dist`` / ``torch-dist-to-hf`` (parsed by megarl/checkpoint/convert_cli.py)."""
    if args.direction == "hf-to-torch-dist":
        path = hf_to_torch_dist(args.hf, args.out, args.force)
    else:
        path = torch_dist_to_hf(args.ckpt, args.out, args.hf_config, args.force)
    print(f"wrote {path}")
