"""``megarl plan``: the per-GPU memory of a run's layout on N GPUs of a given size, term by term.

    megarl plan --model configs/models/qwen2.5-7b.json --config configs/smollm2.yaml \\
        --set trainer.dtype=bfloat16 --gpus 8 --gpu-memory-gb 80
"""
from __future__ import annotations

import json
from pathlib import Path

from megarl.models.config import ModelArgs
from megarl.plan.memory import GIB, Plan


def add_plan_parser(sub, add_config_args) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of a run (weights, gradients, optimizer state, activations, "
                                    "the engine's weights and KV cache, the drafter) and whether it fits")
    add_config_args(p)
    p.add_argument("--model", help="HF model folder or its config.json (default: the run config's model)")
    p.add_argument("--gpus", type=int, required=True, help="processes of the run (one GPU each)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU, GiB (default 80: H100 80GB)")
    p.add_argument("--prompt-len", type=int, default=512,
                   help="longest prompt in tokens (default 512); with rollout.max_new_tokens the longest row")
    p.add_argument("--reserve-gb", type=float, help="memory kept free per GPU outside tensors, GiB "
                                                    "(default: memory.reserve_gb)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="what the run runs on (default cuda)")
    p.add_argument("--json", help="also write the plan here as JSON")


def model_args(path: str, key: str = "--model ") -> ModelArgs:
    """A model's shapes from a HF folder or a config.json file; a ValueError naming ``key`` and the file."""
    f = Path(path)
    f = f / "config.json" if f.is_dir() else f
    if not f.is_file():
        raise FileNotFoundError(f"{key}{path}: no such file (expected a HF model folder or its config.json)")
    try:
        hf = json.loads(f.read_text())
        return ModelArgs.from_hf_config(hf)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{key}{f}: not a usable HF model config ({type(e).__name__}: {e})") from None


def _run_model(cfg) -> ModelArgs:
    """The run config's own model: its HF folder, or a fresh one of the synthetic task's vocabulary."""
    if cfg.model.init_from_hf:
        return model_args(cfg.model.init_from_hf, "model.init_from_hf=")
    if cfg.model.init_from_mcore:
        from megarl.checkpoint.convert import read_meta

        return read_meta(cfg.model.init_from_mcore)[1]
    if cfg.data.source != "addition":
        raise ValueError("megarl plan needs --model (a HF folder or config.json) for a fresh model with "
                         f"data.source={cfg.data.source}: its vocabulary is the tokenizer's")
    from megarl.rl.tokenizer import CharTokenizer

    m = cfg.model
    return ModelArgs(vocab_size=CharTokenizer().vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
                     num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                     tie_word_embeddings=m.tie_word_embeddings, model_type=m.model_type,
                     **({"num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
                         "moe_intermediate_size": m.moe_intermediate_size or m.intermediate_size,
                         "norm_topk_prob": m.norm_topk_prob} if m.num_experts else {}))


def format_plan(p: Plan, device_gib: float) -> str:
    """The plan as a table per GPU kind, the activation figures and the verdict."""
    s = p.spec
    lines = [f"memory plan: {s.gpus} GPUs of {device_gib:g} GiB, {s.placement}; trainer TP={s.tp} PP={s.pp} "
             f"DP={s.dp}{' EP=' + str(s.ep) if s.ep > 1 else ''}, rollout TP={s.rollout_tp}; rows of {s.seq_len} "
             f"tokens ({s.response_len} response)"]
    for kind, terms in p.gpus.items():
        lines += ["", f"{kind:<32} {'GiB':>8}  what", "-" * 72]
        lines += [f"{t.name:<32} {t.bytes / GIB:>8.2f}  {t.note}" for t in terms]
        lines += [f"{'total':<32} {p.total(kind) / GIB:>8.2f}"]
    lines += ["", "activations: " + ", ".join(f"{v / 1024:.1f} KiB {k}" for k, v in p.per_token.items())]
    kind, need = p.peak()
    if p.fits(device_gib):
        lines.append(f"fits: {need / GIB:.1f} of {device_gib:g} GiB on the fullest GPU ({kind})")
    else:
        from megarl.plan.advice import refusal

        lines.append("does not fit: " + refusal(p, device_gib, f"a {device_gib:g} GiB GPU"))
    return "\n".join(lines)


def plan_json(p: Plan, device_gib: float) -> dict:
    return {"gpus": p.spec.gpus, "device_gib": device_gib, "fits": p.fits(device_gib),
            "per_gpu": {kind: {"total_gib": p.total(kind) / GIB, "terms": {t.name: t.bytes / GIB for t in terms}}
                        for kind, terms in p.gpus.items()},
            "activation_bytes": p.per_token}


def run_plan(args, cfg) -> int:
    """``megarl plan`` for the loaded run config ``cfg``: print the plan; exit 0 when it fits, 1
    when it does not (bad input raises: the CLI's one-line error, exit 2)."""
    from megarl.plan.advice import spec_from_run
    from megarl.plan.memory import plan
    from megarl.utils.dataclass_config import check_number
    from megarl.utils.fs import atomic_write_text

    check_number("--gpus", args.gpus, ge=1, integer=True)
    check_number("--gpu-memory-gb", args.gpu_memory_gb, gt=0)
    check_number("--prompt-len", args.prompt_len, ge=1, integer=True)
    margs = model_args(args.model) if args.model else _run_model(cfg)
    _check_layout(cfg, margs, args.gpus)
    seq_len = min(args.prompt_len + cfg.rollout.max_new_tokens, margs.max_position_embeddings)
    reserve = cfg.memory.reserve_gb if args.reserve_gb is None else args.reserve_gb
    check_number("--reserve-gb", reserve, ge=0)
    p = plan(spec_from_run(cfg, margs, args.gpus, seq_len, args.device, reserve))
    print(format_plan(p, args.gpu_memory_gb))
    if args.json:
        atomic_write_text(args.json, json.dumps(plan_json(p, args.gpu_memory_gb), indent=2) + "\n")
    return 0 if p.fits(args.gpu_memory_gb) else 1


def _check_layout(cfg, margs: ModelArgs, gpus: int) -> None:
    """The run's ``parallel`` section on ``gpus`` processes, checked as a start checks it."""
    from megarl.models.mcore_sharding import check_parallel
    from megarl.parallel.layout import Layout

    p = cfg.parallel
    Layout.build(p, gpus, margs.num_attention_heads, margs.num_key_value_heads, margs.num_hidden_layers,
                 margs.num_experts)
    check_parallel(margs, p.trainer_tp, p.trainer_pp, p.trainer_ep, vpp=p.trainer_vpp)
