"""Qwen3 / Qwen3-MoE / Mixtral in megarl's plain-torch model against transformers, their HF
configs, and the HF <-> Megatron names of their layers, with expert-parallel sharding.

transformers computes RMSNorm, the attention softmax, the router softmax and RoPE in float32
even in a float64 model, so HF is a float32 reference here (megarl keeps float64 float64); the
float64 exactness checks are megarl vs Megatron (tests/trainer/test_moe_ep.py)."""
import dataclasses
import tempfile

import pytest
import torch
import transformers

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_model, load_hf_state_dict, save_hf_model
from megarl.models.llama import CausalLM, SparseMoE

COMMON = dict(attn_implementation="eager", vocab_size=53, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-5,
              max_position_embeddings=128)
CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("qwen3", None)]


def hf_model(model_type: str, norm: bool | None, tie: bool = False, seed: int = 0):
    """A tiny HF model: 4 experts, top-2 (MoE types); norms and routers randomised so they matter."""
    kw = dict(COMMON, tie_word_embeddings=tie)
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                          norm_topk_prob=norm, **kw)
    elif model_type == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw)
    else:
        cfg = transformers.Qwen3Config(**kw)
    torch.manual_seed(seed)
    # transformers 5.x runs experts as one grouped matmul by default, which has no float64 kernel
    # (the fp64 comparisons below): its per-expert loop instead.
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF inits norms to ones
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight"):  # a sharper router: top-k decisions far from ties
                p.normal_(0.0, 0.5)
    return model


def checkpoint_state(hf) -> dict[str, torch.Tensor]:
    """``hf``'s weights as its saved folder holds them: transformers 5.x fuses the experts in memory
    (``mlp.experts.gate_up_proj``) but saves the per-expert tensors HF checkpoints carry."""
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return load_hf_state_dict(d)


def ours_from(hf) -> CausalLM:
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    ours = CausalLM(args).eval()
    sd = checkpoint_state(hf)
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight")
    ours.load_state_dict(sd, strict=True)
    return ours


def ids(shape=(3, 17), seed=1):
    return torch.randint(0, COMMON["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type,norm", CASES)
def test_logits_match_transformers(model_type, norm):
    hf = hf_model(model_type, norm)
    ours = ours_from(hf)
    args = ours.args
    assert args.model_type == model_type and args.qk_norm == (model_type != "mixtral")
    if model_type != "qwen3":
        assert (args.num_experts, args.num_experts_per_tok, args.norm_topk_prob) == (4, 2, norm)
        assert args.moe_intermediate_size == (24 if model_type == "qwen3_moe" else 40)
    with torch.no_grad():  # float32 on both sides: the same math, op for op
        diff = (hf(ids()).logits - ours(ids())).abs().max().item()
    assert diff <= 1e-6, diff
    hf, ours = hf.double(), ours.double()
    with torch.no_grad():  # float64: HF's float32 casts (module docstring) bound the agreement
        diff = (hf(ids()).logits - ours(ids())).abs().max().item()
    assert diff <= 1e-6, diff


def test_tokens_route_to_different_experts_and_weights_follow_norm_topk_prob():
    """The test models really are sparse: tokens pick different experts, and the weights sum to 1
    exactly when ``norm_topk_prob`` (otherwise to the top-k probability mass, < 1)."""
    for norm in (True, False):
        moe = ours_from(hf_model("qwen3_moe", norm)).double().model.layers[0].mlp
        x = torch.randn(40, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        weights, experts = moe.route(x)
        assert experts.shape == (40, 2) and len(set(experts.flatten().tolist())) == 4
        sums = weights.sum(-1)
        if norm:
            assert (sums - 1).abs().max() <= 1e-15
        else:
            assert (sums < 1).all()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_is_batch_invariant(model_type):
    """Each token's MoE output is a function of that token only: any subset, any order, gives the
    same rows (float64); and each sequence's logits alone equal its rows in a batch."""
    model = ours_from(hf_model(model_type, True)).double()
    moe: SparseMoE = model.model.layers[1].mlp if model_type == "qwen3_moe" else model.model.layers[1].block_sparse_moe
    x = torch.randn(2, 13, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = moe(x).reshape(26, 48)
        perm = torch.randperm(26, generator=torch.Generator().manual_seed(4))[:9]
        part = moe(x.reshape(26, 48)[perm][None])[0]
        assert (part - full[perm]).abs().max().item() <= 1e-14
        for i in (5, 17):  # one token at a time (the engine's decode step)
            assert (moe(x.reshape(26, 48)[i:i + 1]) - full[i:i + 1]).abs().max().item() <= 1e-14
        batch = ids((3, 11))
        rows = torch.cat([model(batch[i:i + 1]) for i in range(3)])
        assert (rows - model(batch)).abs().max().item() <= 1e-13


# ------------------------------------------------------------------ HF config


@pytest.mark.parametrize("model_type,norm", CASES)
def test_hf_config_round_trip(model_type, norm):
    hf = hf_model(model_type, norm, tie=model_type == "qwen3")
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    cfg = args.to_hf_config()
    assert cfg["architectures"] == [type(hf).__name__]
    back = transformers.AutoConfig.for_model(**cfg)  # the HF config class of cfg["model_type"]
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "intermediate_size", "head_dim", "tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers"):
        if hasattr(hf.config, key):
            assert getattr(back, key) == getattr(hf.config, key), key
    assert ModelArgs.from_hf_config(back.to_dict()) == args
    if model_type in ("qwen3", "mixtral"):
        assert not {"num_experts", "moe_intermediate_size", "norm_topk_prob"} & cfg.keys()


@pytest.mark.parametrize("model_type,norm", [("qwen3_moe", True), ("mixtral", True)])
def test_export_loads_in_transformers(tmp_path, model_type, norm):
    hf = hf_model(model_type, norm, seed=5)
    ours = ours_from(hf)
    out = save_hf_model(ours.state_dict(), ours.args, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), hf.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(reloaded(ids()).logits, hf(ids()).logits)
    again = load_hf_model(out)
    assert again.args == ours.args
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def qwen3_moe_cfg(**kw) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 6, **kw}


@pytest.mark.parametrize("cfg,match", [
    (qwen3_moe_cfg(decoder_sparse_step=2), r"decoder_sparse_step=2 is not supported"),
    (qwen3_moe_cfg(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] is not supported"),
    (qwen3_moe_cfg(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
    (qwen3_moe_cfg(num_experts=0), r"num_experts=0 must be >= 1"),
    (qwen3_moe_cfg(attention_bias=True), r"attention_bias=True is not supported for model_type='qwen3_moe'"),
    ({**qwen3_moe_cfg(), "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
      "router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
])
def test_unsupported_moe_configs_are_rejected(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(cfg)


def test_moe_fields_on_dense_models_are_rejected():
    with pytest.raises(ValueError, match=r"model_type='qwen2' is dense but num_experts=4"):
        ModelArgs(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, model_type="qwen2", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"norm_topk_prob=False is not Mixtral's routing"):
        ModelArgs(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=False)


# ------------------------------------------------------------------ HF <-> Megatron names, EP shards


def moe_args(model_type: str, **kw) -> ModelArgs:
    base = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, model_type=model_type)
    if model_type in ("qwen3_moe", "mixtral"):
        base.update(num_experts=4, num_experts_per_tok=2)
        base.update(moe_intermediate_size=24 if model_type == "qwen3_moe" else 64)
    base.update(kw)
    return ModelArgs(**base)


def random_hf(args: ModelArgs, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in mm.hf_shapes(args).items()}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3"])
def test_hf_names_are_causal_lm_names_and_round_trip_is_bitwise(model_type):
    args = moe_args(model_type)
    model = CausalLM(args)
    assert {k: tuple(v.shape) for k, v in model.hf_state_dict().items()} == mm.hf_shapes(args)
    hf = random_hf(args)
    mc = mm.hf_to_mcore(hf, args)
    assert {k: tuple(v.shape) for k, v in mc.items()} == mm.mcore_shapes(args)
    back = mm.mcore_to_hf(mc, args)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_moe_mapping_layout():
    """Layer 2 of a Qwen3-MoE and of a Mixtral model: the router, an expert's fused [gate; up]
    fc1 and its fc2, the q/k norms, checked against the HF tensors they come from."""
    for model_type, block, (gate, up, down) in (("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
                                                ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"))):
        args = moe_args(model_type)
        hf = random_hf(args)
        mc = mm.hf_to_mcore(hf, args)
        p, q = f"model.layers.2.{block}.", "decoder.layers.2.mlp."
        assert torch.equal(mc[q + "router.weight"], hf[p + "gate.weight"])
        e = p + "experts.3."
        assert torch.equal(mc[q + "experts.local_experts.3.linear_fc1.weight"],
                           torch.cat([hf[e + f"{gate}.weight"], hf[e + f"{up}.weight"]]))
        assert torch.equal(mc[q + "experts.local_experts.3.linear_fc2.weight"], hf[e + f"{down}.weight"])
        assert not any(k.startswith(q + "linear_fc") for k in mc)
        norms = {k for k in mc if "layernorm" in k and k.startswith("decoder.layers.2.self_attention")}
        if model_type == "qwen3_moe":
            assert torch.equal(mc["decoder.layers.2.self_attention.q_layernorm.weight"],
                               hf["model.layers.2.self_attn.q_norm.weight"])
            assert torch.equal(mc["decoder.layers.2.self_attention.k_layernorm.weight"],
                               hf["model.layers.2.self_attn.k_norm.weight"])
        else:
            assert not norms


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 2)])
def test_expert_parallel_shard_merge_round_trip(tp, pp, ep):
    args = moe_args("qwen3_moe")
    full = mm.hf_to_mcore(random_hf(args), args)
    local = ms.shard(full, args, tp, pp, ep=ep)
    assert set(local) == {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    for (t, p, e), sd in local.items():
        assert {k: tuple(v.shape) for k, v in sd.items()} == ms.local_shapes(args, tp, pp, t, p, ep=ep, ep_rank=e)
        experts = {k.split("local_experts.")[1].split(".")[0] for k in sd if "local_experts" in k}
        assert experts == {str(j) for j in range(4 // ep)}  # renumbered from 0 on every EP rank
        # Global expert e*4/ep + j of global layer p*2 + 1 is local expert j of local layer 1.
        j, g = 4 // ep - 1, (e + 1) * (4 // ep) - 1
        w = full[f"decoder.layers.{p * 2 + 1}.mlp.experts.local_experts.{g}.linear_fc2.weight"]
        assert torch.equal(sd[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"],
                           w.chunk(tp, dim=1)[t])
        assert torch.equal(sd["decoder.layers.1.mlp.router.weight"], full[f"decoder.layers.{p * 2 + 1}.mlp.router.weight"])
    back = ms.merge(local, args, tp, pp, ep=ep)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


@pytest.mark.parametrize("model_type", ["qwen3", "mixtral"])
def test_tp_pp_shard_merge_round_trip(model_type):
    """q/k norms are replicated over TP; Mixtral's experts are cut like dense MLPs (ep=1)."""
    args = moe_args(model_type)
    full = mm.hf_to_mcore(random_hf(args), args)
    local = ms.shard(full, args, 2, 2)
    assert set(local) == {(t, p) for t in range(2) for p in range(2)}
    if model_type == "qwen3":
        assert torch.equal(local[(1, 1)]["decoder.layers.0.self_attention.q_layernorm.weight"],
                           full["decoder.layers.2.self_attention.q_layernorm.weight"])
    back = ms.merge(local, args, 2, 2)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


def test_expert_parallel_errors():
    args = moe_args("qwen3_moe")
    full = mm.hf_to_mcore(random_hf(args), args)
    with pytest.raises(ValueError, match=r"ep=3 does not divide num_experts=4; valid ep: \[1, 2, 4\]"):
        ms.shard(full, args, 1, 1, ep=3)
    dense = moe_args("qwen3")
    with pytest.raises(ValueError, match=r"ep=2 needs an MoE model; model_type='qwen3' is dense"):
        ms.check_parallel(dense, 1, 1, 2)
    with pytest.raises(ValueError, match=r"tp=8 does not divide moe_intermediate_size=20"):
        ms.check_parallel(dataclasses.replace(args, num_attention_heads=8, num_key_value_heads=8,
                                              moe_intermediate_size=20), 8, 1)
    local = ms.shard(full, args, 1, 1, ep=2)
    local[(0, 0, 1)] = dict(local[(0, 0, 1)])
    key = "decoder.layers.0.mlp.router.weight"
    local[(0, 0, 1)][key] = local[(0, 0, 1)][key] + 1
    with pytest.raises(ValueError, match=rf"tensor {key} of \(tp_rank=0, pp_rank=0\) differs between ep_rank=0 "
                                         r"and ep_rank=1"):
        ms.merge(local, args, 1, 1, ep=2)
    with pytest.raises(ValueError, match=r"ranks \(tp_rank, pp_rank, ep_rank\)"):
        ms.merge({(0, 0): local[(0, 0, 0)]}, args, 1, 1, ep=2)


# ------------------------------------------------------------------ the rollout engine


def test_engine_rollouts_of_an_moe_model_are_batch_invariant():
    """The engine runs Qwen3-MoE (packed rows, KV cache) and a request's tokens and logprobs do not
    depend on the requests batched with it (docs/design.md §1), in float64."""
    from megarl.engine import Engine, EngineConfig, Request, SamplingParams

    model = ours_from(hf_model("qwen3_moe", True))
    reqs = [Request(uid=7 + i // 2, sample_idx=i % 2, prompt_ids=[3 + i, 9, 4 + 2 * i][: 1 + i % 3],
                    params=SamplingParams(max_new_tokens=6 + i % 4, temperature=1.0 if i % 3 else 0.0))
            for i in range(6)]

    def run(batch, max_batch_size):
        eng = Engine(model, EngineConfig(max_batch_size=max_batch_size, max_seq_len=32, dtype="float64"), seed=11)
        return eng.generate(batch, step=2)

    batched = run(reqs, 4)
    solo = [run([r], 1)[0] for r in reqs]
    assert [r.tokens for r in batched] == [r.tokens for r in solo]
    assert [len(r.tokens) for r in batched] == [q.params.max_new_tokens for q in reqs]  # no eos id: full length
    for b, s in zip(batched, solo):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-12)
