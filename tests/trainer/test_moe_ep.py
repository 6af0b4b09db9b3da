"""Megatron-core MoE (Qwen3-MoE, Mixtral) built from ModelArgs == megarl's CausalLM, and expert
parallelism EP=2 == EP=1 on 2 gloo processes (logits and gradients, float64)."""
import dataclasses
from pathlib import Path

import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.trainer.model import build_gpt_model, gpt_logits, load_state, transformer_config

from tests.torchrun import torchrun
from .moe_ep_worker import CASES, EP, case_args, rank_inputs
from .shard_worker import logits_loss
from .test_model import reference

# (model_type, norm_topk_prob): post-softmax and pre-softmax routing, Mixtral's names, dense Qwen3.
PARITY = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("qwen3", None)]


def parity_args(make_args, model_type, norm):
    if model_type == "qwen3":
        return make_args("qwen3", head_dim=16)
    ff = 24 if model_type == "qwen3_moe" else 64  # Mixtral's experts have width intermediate_size
    return make_args(model_type, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=ff,
                     norm_topk_prob=norm)


@pytest.mark.parametrize("model_type,norm", PARITY)
def test_logits_match_causal_lm_fp64(dims, make_args, model_type, norm):
    args = parity_args(make_args, model_type, norm)
    ref = reference(args, seed=3, dtype=torch.float64)
    model = build_gpt_model(args, dims, torch.float64, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    load_state(model, mm.hf_to_mcore(ref.hf_state_dict(), args))
    ids = torch.randint(0, args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (gpt_logits(model, ids) - ref(ids)).abs().max().item() <= 1e-12


def test_logits_match_causal_lm_fp32(dims, make_args):
    args = parity_args(make_args, "qwen3_moe", True)
    ref = reference(args, seed=3)
    model = build_gpt_model(args, dims, torch.float32, seed=0)
    load_state(model, mm.hf_to_mcore(ref.hf_state_dict(), args))
    ids = torch.randint(0, args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (gpt_logits(model, ids) - ref(ids)).abs().max().item() <= 1e-5


def test_moe_config(dims, make_args):
    """The router settings that reproduce HF's routing, and no auxiliary loss."""
    for norm, pre_softmax in ((True, False), (False, True)):
        cfg = transformer_config(parity_args(make_args, "qwen3_moe", norm), dims, torch.float64)
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 24)
        assert cfg.moe_router_score_function == "softmax" and cfg.moe_router_pre_softmax == pre_softmax
        assert cfg.moe_aux_loss_coeff == 0 and cfg.moe_expert_capacity_factor is None and cfg.qk_layernorm
    assert transformer_config(make_args("qwen2"), dims, torch.float32).num_moe_experts is None
    with pytest.raises(ValueError, match=r"MoE models need tp=1 \(got tp=2\)"):
        transformer_config(parity_args(make_args, "qwen3_moe", True), dataclasses.replace(dims, tp=2), torch.float32)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=1 with norm_topk_prob=True is not supported"):
        transformer_config(make_args("qwen3_moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8,
                                     norm_topk_prob=True), dims, torch.float32)


# ------------------------------------------------------------------ multi-process: EP=2


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """The 2 ranks' results of moe_ep_worker.py (one torchrun launch for every case)."""
    out = tmp_path_factory.mktemp("moe_ep")
    torchrun(Path(__file__).parent / "moe_ep_worker.py", EP, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(EP)]


@pytest.fixture(scope="module")
def ep1(dims):
    """Per case: the full fp64 weights, and the EP=1 model's logits and gradients of each rank's batch."""
    out = {}
    for case in CASES:
        args = case_args(*case)
        full = mm.hf_to_mcore(reference(args, seed=3, dtype=torch.float64).hf_state_dict(), args)
        model = build_gpt_model(args, dims, torch.float64, seed=0)
        load_state(model, full)
        logits, grads = [], []
        for r in range(EP):
            model.zero_grad()
            lg = gpt_logits(model, rank_inputs(args, r))
            logits_loss(lg).backward()
            logits.append(lg.detach())
            grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        out[case] = {"args": args, "full": full, "logits": logits, "grads": grads}
    return out


def global_name(key: str, ep_rank: int, per_rank: int) -> str:
    """The EP=1 name of an EP rank's local expert tensor (``local_experts.j`` -> ``r*per + j``)."""
    head, tail = key.split("local_experts.")
    j, rest = tail.split(".", 1)
    return f"{head}local_experts.{ep_rank * per_rank + int(j)}.{rest}"


@pytest.mark.multiproc
def test_ep2_state_dicts_are_the_shards(ep_runs, ep1):
    assert sorted((r["ep_rank"], r["dp_rank"], r["ep"], r["dp"]) for r in ep_runs) == [(0, 0, 2, 2), (1, 1, 2, 2)]
    for case in CASES:
        args, full = ep1[case]["args"], ep1[case]["full"]
        local = {(0, 0, r["ep_rank"]): r["cases"][case]["loaded"] for r in ep_runs}
        for (_, _, e), sd in local.items():
            init = ep_runs[e]["cases"][case]["init"]
            assert {k: tuple(v.shape) for k, v in init.items()} == ms.local_shapes(args, 1, 1, 0, 0, ep=EP, ep_rank=e)
        merged = ms.merge(local, args, 1, 1, ep=EP)  # also checks the dense copies agree over EP
        assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
        # Megatron's seeded init already gives the EP ranks equal dense weights and routers.
        ms.merge({(0, 0, r["ep_rank"]): r["cases"][case]["init"] for r in ep_runs}, args, 1, 1, ep=EP)


@pytest.mark.multiproc
def test_ep2_logits_match_ep1(ep_runs, ep1):
    for case in CASES:
        for r in ep_runs:
            got, want = r["cases"][case]["logits"], ep1[case]["logits"][r["ep_rank"]]
            assert got.shape == want.shape and got.dtype == torch.float64
            assert (got - want).abs().max().item() <= 1e-10, (case, r["ep_rank"])
            # Every rank sent tokens to both EP ranks in every layer: the all-to-all was exercised.
            assert all(min(splits) > 0 for splits in r["cases"][case]["input_splits"]), r["cases"][case]["input_splits"]


@pytest.mark.multiproc
def test_ep2_gradients_match_ep1(ep_runs, ep1):
    """Rank r's dense and router gradients are the EP=1 gradients of its own batch (DP, before
    the all-reduce); an expert's gradients, on the EP rank holding it, are the EP=1 gradients of
    both ranks' batches: the all-to-all brings it every token routed to it."""
    for case in CASES:
        per_rank = case_args(*case).num_experts // EP
        want = ep1[case]["grads"]
        for r in ep_runs:
            e = r["ep_rank"]
            got = r["cases"][case]["grads"]
            assert got.keys() == ms.local_shapes(case_args(*case), 1, 1, 0, 0, ep=EP, ep_rank=e).keys()
            for k, g in got.items():
                if "local_experts." in k:
                    name = global_name(k, e, per_rank)
                    w = want[0][name] + want[1][name]
                else:
                    w = want[e][k]
                assert w.abs().max() > 0, k  # every tensor takes part in the loss
                assert (g - w).abs().max().item() <= 1e-10 * max(1.0, w.abs().max().item()), (case, e, k)
