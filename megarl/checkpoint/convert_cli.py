"""``megarl convert``: HF <-> Megatron pieces (megarl/checkpoint/convert.py) and GGUF -> HF
(megarl/models/gguf.py), as a subcommand of ``megarl`` and as ``python -m megarl.checkpoint.convert_cli``;
and the parsers of HF <-> Megatron-core torch_dist, which only ``megarl convert`` runs
(megarl/trainer/dist_convert.py: the trainer's side of the package layers)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.checkpoint.convert import ConvertReport, check_out, hf_to_mcore, mcore_to_hf


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """``convert hf-to-mcore`` / ``convert mcore-to-hf`` under a ``megarl`` subparsers object."""
    p = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and megarl's Megatron layout")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF folder -> per-rank Megatron pieces + meta.json")
    a.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output folder (must be absent or empty unless --force)")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    a.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    a.add_argument("--vpp", type=int, default=1,
                   help="virtual pipeline stages per pipeline rank (interleaved 1F1B; needs --pp >= 2): "
                        "pp*vpp must divide the layers")
    b = sub.add_parser("mcore-to-hf", help="per-rank Megatron pieces -> HF folder")
    b.add_argument("--ckpt", required=True, help="folder written by hf-to-mcore")
    b.add_argument("--out", required=True, help="output HF folder (must be absent or empty unless --force)")
    b.add_argument("--max-shard-mb", type=float, default=5000, help="largest HF weight file, MiB")
    c = sub.add_parser("gguf-to-hf", help="GGUF file (llama.cpp) -> HF folder: dequantised weights, tokenizer.json, "
                                          "tokenizer_config.json with the chat template (Llama/Qwen2/Qwen3, BPE)")
    c.add_argument("--gguf", required=True, help="the .gguf file")
    c.add_argument("--out", required=True, help="output HF folder (must be absent or empty unless --force)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights' dtype (default float32: the dequantised values exactly)")
    d = sub.add_parser("hf-to-torch-dist", help="HF folder -> Megatron-core distributed checkpoint (torch_dist, the "
                                               "format Megatron-LM loads; reshards on load into any TP/PP layout)")
    d.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    d.add_argument("--out", required=True, help="output folder (must be absent or empty unless --force)")
    e = sub.add_parser("torch-dist-to-hf", help="Megatron-core distributed checkpoint (torch_dist: from hf-to-torch-dist, "
                                               "a run's checkpoints/step_N/trainer, Megatron-LM) -> HF folder")
    e.add_argument("--ckpt", required=True, help="the torch_dist checkpoint folder (metadata.json, *.distcp)")
    e.add_argument("--out", required=True, help="output HF folder (must be absent or empty unless --force)")
    e.add_argument("--hf-config", help="HF folder whose config.json (and tokenizer) describe the model, for a "
                                       "checkpoint that records none")
    for q in (a, b, c, d, e):
        q.add_argument("--force", action="store_true", help="replace a non-empty --out")
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_convert(args: argparse.Namespace) -> ConvertReport | None:
    if args.direction in ("hf-to-torch-dist", "torch-dist-to-hf"):  # Megatron's format: the trainer's side
        raise ValueError(f"convert {args.direction} runs as `megarl convert {args.direction}` (megarl/trainer/"
                         f"dist_convert.py)")
    if args.direction == "gguf-to-hf":
        from megarl.models.gguf import gguf_to_hf

        check_out(Path(args.out), args.force, Path(args.gguf))
        print(gguf_to_hf(args.gguf, args.out, dtype=args.dtype, progress=not args.no_progress))
        return None
    if args.direction == "hf-to-mcore":
        report = hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep, args.force, not args.no_progress,
                             vpp=args.vpp)
    else:
        report = mcore_to_hf(args.ckpt, args.out, args.max_shard_mb, args.force, not args.no_progress)
    print(report.line())
    return report


def main_convert(argv: list[str] | None = None) -> ConvertReport:
    parser = argparse.ArgumentParser(prog="megarl")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    return run_convert(parser.parse_args(["convert", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main_convert()
