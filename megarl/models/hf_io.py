"""Reading and writing Hugging Face model folders (``config.json`` + safetensors).

Writes go to a temporary sibling directory that is renamed into place only when complete, so
an interrupted export never leaves a folder that looks valid.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.models.catalog import missing_hint
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.utils.fs import atomic_dir, safetensors_os_errors, umask

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(path: str | os.PathLike) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"HF model folder {path} has no config.json (expected {cfg_path}){missing_hint(path)}")
    with open(cfg_path) as f:
        return json.load(f)


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a HF folder: the single file, or every shard named by the index."""
    path = Path(path)
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        with open(path / INDEX_FILE) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"HF model folder {path}: shards named in {INDEX_FILE} are missing: {missing}")
        return [path / s for s in shards]
    raise FileNotFoundError(
        f"HF model folder {path} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} (safetensors only)"
    )


def load_hf_state_dict(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if dtype is not None else t
    return out


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A megarl ``CausalLM`` from a HF folder; missing or unexpected tensors are an error."""
    args = ModelArgs.from_hf_config(read_hf_config(path))
    model = CausalLM(args).to(dtype)
    sd = load_hf_state_dict(path, dtype)
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    load_named(model, sd, source=str(path))
    return model


def load_named(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` with an error that names every missing, unexpected or mis-shaped tensor."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = [f"{k}: expected {tuple(own[k].shape)}, got {tuple(sd[k].shape)}"
              for k in own.keys() & sd.keys() if own[k].shape != sd[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(
            f"weights from {source} do not fit the model: missing={missing} unexpected={unexpected} "
            f"shape mismatches={shapes}"
        )
    with torch.no_grad():
        for k, v in sd.items():
            own[k].copy_(v)


def save_hf_model(state_dict: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike,
                  write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` atomically;
    ``write_extra(tmp_dir)`` adds files (the tokenizer) before the folder appears. Returns it."""
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    with atomic_dir(out_dir) as tmp:
        with open(tmp / "config.json", "w") as f:
            json.dump(args.to_hf_config(torch_dtype=dtype), f, indent=2)
        with safetensors_os_errors(tmp / SINGLE_FILE):
            save_file(sd, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        os.chmod(tmp / SINGLE_FILE, 0o666 & ~umask())  # safetensors writes 0600; a model folder is shared
        gen = {k: getattr(args, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if getattr(args, k) is not None}
        with open(tmp / "generation_config.json", "w") as f:
            json.dump({**gen, "do_sample": False}, f, indent=2)
        if write_extra is not None:
            write_extra(tmp)
    return Path(out_dir)
