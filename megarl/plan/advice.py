"""A run's plan from its config, and the changes that would make a plan fit.

Only this module reads the run config (and only the fields the plan needs): the arithmetic in
:mod:`megarl.plan.memory` sees a flat :class:`PlanSpec`.
"""
from __future__ import annotations

import math

from megarl.models.config import ModelArgs
from megarl.plan.memory import GIB, Plan, PlanSpec, plan


def spec_from_run(cfg, args: ModelArgs, gpus: int, seq_len: int, device: str, reserve_gib: float = 0.0) -> PlanSpec:
    """The plan's inputs from a ``RunConfig`` ``cfg``, the model ``args``, ``gpus`` processes and
    the longest prompt + response ``seq_len``."""
    p, t, r, sp = cfg.parallel, cfg.trainer, cfg.rollout, cfg.spec
    trainer_gpus = gpus - p.rollout_ranks if p.placement == "disaggregated" else gpus
    dp = max(1, trainer_gpus // (p.trainer_tp * p.trainer_pp))
    drafter = sp.enabled and sp.drafter.enabled
    return PlanSpec(
        args=args, gpus=gpus, placement=p.placement, rollout_ranks=p.rollout_ranks, tp=p.trainer_tp,
        pp=p.trainer_pp, vpp=p.trainer_vpp, ep=p.trainer_ep, rollout_tp=p.rollout_tp,
        sequence_parallel=bool(getattr(p, "sequence_parallel", False)), trainer_dtype=t.dtype,
        distributed_optimizer=t.distributed_optimizer, recompute=t.recompute, attention=t.attention,
        micro_batch_size=t.micro_batch_size, micro_batch_tokens=t.micro_batch_tokens, seq_len=seq_len,
        response_len=min(r.max_new_tokens, seq_len),
        rows_per_dp_rank=math.ceil(r.prompts_per_step * r.group_size / dp), kl_reference=cfg.grpo.kl_coef > 0,
        rollout_dtype=r.dtype, max_batch_size=r.max_batch_size, kv_cache=r.kv_cache,
        spec_tokens=max(sp.k_max, sp.drafter.k if drafter else 0) if sp.enabled else 0, drafter=drafter,
        drafter_buffer_tokens=sp.drafter.buffer_tokens, drafter_window=sp.drafter.window, device=device,
        cpu_packed_linears=r.cpu_packed_linears, weight_sync_bucket_mb=p.weight_sync_bucket_mb,
        reserve_gib=reserve_gib)


def _divides(n: int, *xs: int) -> bool:
    return all(x > 0 and n % x == 0 for x in xs)


def _candidates(s: PlanSpec) -> list[tuple[str, PlanSpec]]:
    """Single changes that lower memory, as (the config key to set, the changed spec), cheapest
    in speed first: sharding the optimizer costs no compute, recompute one more forward, model
    parallelism communication."""
    a, out = s.args, []
    if s.attention == "eager":  # SDPA: the same step without the [L, L] probabilities
        out.append(("trainer.attention=sdpa", s.replace(attention="sdpa")))
    if not s.distributed_optimizer and s.dp > 1 and s.trainer_dtype != "float64":
        out.append(("trainer.distributed_optimizer=true", s.replace(distributed_optimizer=True)))
    for rc in ("selective", "full"):
        if ("none", "selective", "full").index(rc) > ("none", "selective", "full").index(s.recompute):
            out.append((f"trainer.recompute={rc}", s.replace(recompute=rc)))
    if s.micro_batch_tokens <= 0 and s.micro_batch_size > 1:
        out.append(("trainer.micro_batch_size=1", s.replace(micro_batch_size=1)))
    tp = s.tp * 2
    if _divides(s.trainer_gpus, tp * s.pp) and _divides(a.num_attention_heads, tp) and \
            _divides(a.num_key_value_heads, tp) and not a.is_moe:
        out.append((f"parallel.trainer_tp={tp}", s.replace(tp=tp)))
    pp = s.pp * 2
    if _divides(s.trainer_gpus, s.tp * pp) and _divides(a.num_hidden_layers, pp * s.vpp):
        out.append((f"parallel.trainer_pp={pp}", s.replace(pp=pp)))
    rtp = s.rollout_tp * 2
    rollout_gpus = s.rollout_ranks if s.placement == "disaggregated" else s.gpus
    if _divides(rollout_gpus, rtp) and _divides(a.num_attention_heads, rtp) and _divides(a.num_key_value_heads, rtp):
        out.append((f"parallel.rollout_tp={rtp}", s.replace(rollout_tp=rtp)))
    if s.max_batch_size > 1:
        out.append((f"rollout.max_batch_size={s.max_batch_size // 2}", s.replace(max_batch_size=s.max_batch_size // 2)))
    return out


def what_fits(s: PlanSpec, device_gib: float, limit: int = 3, depth: int = 4) -> list[tuple[str, float]]:
    """Up to ``limit`` single changes after which the plan fits, with the peak GiB per GPU each
    gives; else one combination of up to ``depth`` changes, each the one that lowers the peak most
    (greedy); empty when even that does not fit."""
    singles = [(key, plan(c)) for key, c in _candidates(s)]
    found = [(key, p.peak()[1] / GIB) for key, p in singles if p.fits(device_gib)]
    if found:
        return found[:limit]
    keys, spec = [], s
    for _ in range(depth):
        options = [(plan(c).peak()[1], key, c) for key, c in _candidates(spec)
                   if key.split("=")[0] not in {k.split("=")[0] for k in keys}]
        if not options:
            return []
        need, key, spec = min(options, key=lambda o: o[0])
        keys.append(key)
        if need <= device_gib * GIB:
            return [(" and ".join(keys), need / GIB)]
    return []


def refusal(p: Plan, device_gib: float, where: str) -> str:
    """One message for a plan that does not fit: the need, the biggest term, what would fit."""
    kind, need = p.peak()
    big = p.biggest(kind)
    fixes = what_fits(p.spec, device_gib)
    fix = ("; it would fit with " + ", or ".join(f"{k} ({gib:.1f} GiB)" for k, gib in fixes)) if fixes else \
        "; no combination of up to 4 changes of the layout, optimizer, recompute and batch settings fits: more GPUs"
    return (f"the memory plan needs {need / GIB:.1f} GiB per GPU ({kind}) but {where} has {device_gib:.1f} GiB; "
            f"the biggest term is {big.name}, {big.bytes / GIB:.1f} GiB ({big.note}){fix} "
            f"(`megarl plan` prints every term; memory.check=false skips this check)")
