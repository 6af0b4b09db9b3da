"""TP/PP sharding of the Megatron-core state dict (megarl.models.mcore_sharding) and the sharded
GPTModel: bitwise round trips, the layout of each piece, loud errors, and on 4 gloo processes
(TP2, PP2, TP2xPP2) the real Megatron state dicts and logits against the TP=1 PP=1 model."""
import dataclasses
from pathlib import Path

import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.trainer.model import build_gpt_model, gpt_logits, load_state
from megarl.trainer.trainer import Trainer, TrainerConfig

from tests.conftest import tiny_args
from tests.torchrun import torchrun
from .shard_worker import CASES, LAYOUTS, TRAIN_STEPS, case_args, case_inputs, logits_loss, train_config, train_steps
from .test_model import reference


def random_full(args, seed=0):
    """A full mcore state dict with distinct random values everywhere (norms included)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in mm.mcore_shapes(args).items()}


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items() if not k.endswith("_extra_state")}


# ------------------------------------------------------------------ pure tensor: round trips


@pytest.mark.parametrize("model_type,tie", [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_merge_shard_round_trip_is_bitwise(model_type, tie, kv):
    args = tiny_args(model_type, tie=tie, num_key_value_heads=kv, num_hidden_layers=6)
    full = random_full(args)
    layouts = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3) if kv % tp == 0]
    assert len(layouts) == 3 * {1: 1, 2: 2, 4: 3}[kv]
    for tp, pp in layouts:
        local = ms.shard(full, args, tp, pp)
        assert set(local) == {(t, p) for t in range(tp) for p in range(pp)}
        for (t, p), sd in local.items():
            assert shapes(sd) == ms.local_shapes(args, tp, pp, t, p), (tp, pp, t, p)
        back = ms.merge(local, args, tp, pp)
        assert back.keys() == full.keys(), (tp, pp)
        for k in full:
            assert back[k].dtype == full[k].dtype and torch.equal(back[k], full[k]), (tp, pp, k)


def test_vocab_padding():
    assert ms.padded_vocab(40, 1) == 40  # TP=1 keeps the exact vocab (megarl's TP=1 model)
    assert ms.padded_vocab(40, 2) == 256 and ms.padded_vocab(256, 2) == 256 and ms.padded_vocab(257, 2) == 512
    assert ms.padded_vocab(100, 4, vocab_multiple=8) == 128
    args = tiny_args("llama", tie=True)
    full = random_full(args)
    local = ms.shard(full, args, tp=2, pp=1)
    emb = torch.cat([local[(0, 0)]["embedding.word_embeddings.weight"],
                     local[(1, 0)]["embedding.word_embeddings.weight"]])
    assert emb.shape == (256, 32) and torch.equal(emb[:40], full["embedding.word_embeddings.weight"])
    assert not emb[40:].any()  # zero padding rows
    assert "output_layer.weight" not in local[(0, 0)]  # tied, one stage: the embedding is the head
    args = tiny_args("qwen2", vocab_size=200)  # padded to 256: rank 0 rows 0..127, rank 1 128..199 + 56 zeros
    full = random_full(args)
    local = ms.shard(full, args, tp=2, pp=1)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        r0, r1 = local[(0, 0)][key], local[(1, 0)][key]
        assert r0.shape == r1.shape == (128, 32)
        assert torch.equal(r0, full[key][:128]) and torch.equal(r1[:72], full[key][128:]) and not r1[72:].any()


# ------------------------------------------------------------------ pure tensor: what each piece is


def test_pieces_follow_megatron_layout():
    """TP=2 x PP=2 pieces, checked against the HF tensors they come from (not against merge)."""
    args = tiny_args("qwen2", tie=True, num_hidden_layers=4)  # 4 q heads, 2 kv heads, d=8, ff=64
    torch.manual_seed(0)
    hf = {k: torch.randn(s, dtype=torch.float64) for k, s in mm.hf_shapes(args).items()}
    local = ms.shard(mm.hf_to_mcore(hf, args), args, tp=2, pp=2)
    last = local[(1, 1)]  # tp_rank 1 of the last stage: global layer 3 is its local layer 1
    p, q = "model.layers.3.", "decoder.layers.1."
    # qkv: KV group 1 = query heads 2, 3 (rows 16..31), then k_1, then v_1.
    want = torch.cat([hf[p + "self_attn.q_proj.weight"][16:32], hf[p + "self_attn.k_proj.weight"][8:16],
                      hf[p + "self_attn.v_proj.weight"][8:16]])
    assert torch.equal(last[q + "self_attention.linear_qkv.weight"], want)
    want_b = torch.cat([hf[p + "self_attn.q_proj.bias"][16:32], hf[p + "self_attn.k_proj.bias"][8:16],
                        hf[p + "self_attn.v_proj.bias"][8:16]])
    assert torch.equal(last[q + "self_attention.linear_qkv.bias"], want_b)
    # o_proj: the input columns of query heads 2, 3.
    assert torch.equal(last[q + "self_attention.linear_proj.weight"], hf[p + "self_attn.o_proj.weight"][:, 16:32])
    # fc1: this rank's halves of gate and of up, stacked.
    assert torch.equal(last[q + "mlp.linear_fc1.weight"],
                       torch.cat([hf[p + "mlp.gate_proj.weight"][32:], hf[p + "mlp.up_proj.weight"][32:]]))
    assert torch.equal(last[q + "mlp.linear_fc2.weight"], hf[p + "mlp.down_proj.weight"][:, 32:])
    assert torch.equal(last[q + "input_layernorm.weight"], hf[p + "input_layernorm.weight"])  # replicated
    assert torch.equal(last["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    # Tied embeddings with PP > 1: the last stage's copy under output_layer.weight (vocab rows
    # 128..255 of the padded vocab on tp_rank 1: all padding for vocab 40).
    assert last["output_layer.weight"].shape == (128, 32) and not last["output_layer.weight"].any()
    assert torch.equal(local[(0, 1)]["output_layer.weight"][:40], hf["model.embed_tokens.weight"])
    assert torch.equal(local[(0, 0)]["embedding.word_embeddings.weight"][:40], hf["model.embed_tokens.weight"])
    # Stage placement: embedding first only, final norm / head last only, layers renumbered.
    first = local[(0, 0)]
    assert "decoder.final_layernorm.weight" not in first and "output_layer.weight" not in first
    assert "embedding.word_embeddings.weight" not in last
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0", "1"}
    assert torch.equal(first["decoder.layers.1.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])


# ------------------------------------------------------------------ loud errors


@pytest.mark.parametrize("kw,tp,pp,match", [
    ({"num_attention_heads": 4, "num_key_value_heads": 4}, 3, 1,
     r"tp=3 does not divide num_attention_heads=4.*\[1, 2, 4\]"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 4, 1,
     r"tp=4 does not divide num_key_value_heads=2.*\[1, 2\]"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 64, "intermediate_size": 36}, 8, 1,
     r"tp=8 does not divide intermediate_size=36.*\[1, 2, 4\]"),
    ({"num_hidden_layers": 4}, 1, 3, r"pp=3 does not divide num_hidden_layers=4; valid pp: \[1, 2, 4\]"),
])
def test_invalid_layouts_raise(kw, tp, pp, match):
    args = tiny_args("qwen2", **kw)
    with pytest.raises(ValueError, match=match):
        ms.shard(random_full(args), args, tp, pp)
    with pytest.raises(ValueError, match=match):
        ms.merge({}, args, tp, pp)


def test_shard_rejects_bad_full_state_dict():
    args = tiny_args("qwen2")
    full = random_full(args)
    del full["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.1.mlp.linear_fc2.weight'\]"):
        ms.shard(full, args, 2, 1)


def test_merge_rejects_bad_local_state_dicts():
    args = tiny_args("llama", tie=True, num_hidden_layers=4)
    full = random_full(args)

    def case(edit):
        local = ms.shard(full, args, 2, 2)
        local = {r: dict(sd) for r, sd in local.items()}
        edit(local)
        return local

    with pytest.raises(ValueError, match=r"rank \(tp_rank=1, pp_rank=0\).*missing \['decoder.layers.0.mlp.linear_fc1"):
        ms.merge(case(lambda l: l[(1, 0)].pop("decoder.layers.0.mlp.linear_fc1.weight")), args, 2, 2)
    with pytest.raises(ValueError, match=r"rank \(tp_rank=0, pp_rank=1\).*unexpected \['decoder.layers.2.input"):
        ms.merge(case(lambda l: l[(0, 1)].__setitem__("decoder.layers.2.input_layernorm.weight",
                                                       torch.ones(32, dtype=torch.float64))), args, 2, 2)
    with pytest.raises(ValueError, match=r"linear_proj.weight has shape \(32, 32\), expected \(32, 16\)"):
        ms.merge(case(lambda l: l[(0, 0)].__setitem__("decoder.layers.0.self_attention.linear_proj.weight",
                                                       torch.zeros(32, 32, dtype=torch.float64))), args, 2, 2)
    with pytest.raises(ValueError, match=r"ranks \(tp_rank, pp_rank\)"):
        ms.merge(case(lambda l: l.pop((1, 1))), args, 2, 2)
    with pytest.raises(ValueError, match=r"tied embeddings: the last stage's copy"):
        ms.merge(case(lambda l: l[(1, 1)].__setitem__("output_layer.weight", l[(1, 1)]["output_layer.weight"] + 1)),
                 args, 2, 2)
    with pytest.raises(ValueError, match=r"replicated tensor decoder.final_layernorm.weight of pp_rank=1 differs"):
        ms.merge(case(lambda l: l[(1, 1)].__setitem__("decoder.final_layernorm.weight",
                                                       l[(1, 1)]["decoder.final_layernorm.weight"] * 2)), args, 2, 2)
    extra = case(lambda l: l[(0, 0)].__setitem__("decoder.layers.0.mlp.linear_fc1._extra_state", None))
    assert torch.equal(ms.merge(extra, args, 2, 2)["embedding.word_embeddings.weight"],
                       full["embedding.word_embeddings.weight"])  # _extra_state is ignored


# ------------------------------------------------------------------ multi-process: real Megatron


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Per layout, the 4 ranks' results of shard_worker.py (one torchrun launch for all layouts)."""
    out = tmp_path_factory.mktemp("sharded")
    torchrun(Path(__file__).parent / "shard_worker.py", 4, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    return {layout: [r[layout] for r in ranks] for layout in LAYOUTS}


@pytest.fixture(scope="module")
def full_states():
    """The seeded fp64 reference weights of each case, as full mcore state dicts."""
    out = {}
    for case in CASES:
        args = case_args(*case)
        out[case] = mm.hf_to_mcore(reference(args, seed=3, dtype=torch.float64).hf_state_dict(), args)
    return out


def layout_id(lay) -> str:
    tp, pp, vpp = lay
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp > 1 else "")


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_megatron_state_dicts_are_the_shards(sharded_runs, full_states, layout):
    tp, pp, vpp = layout
    stages = pp * vpp
    runs = sharded_runs[layout]
    assert sorted((r["tp_rank"], r["pp_rank"], r["dp_rank"]) for r in runs) == sorted(
        (t, p, d) for t in range(tp) for p in range(pp) for d in range(4 // (tp * pp)))
    for case in CASES:
        args, full = case_args(*case), full_states[case]
        local = ms.shard(full, args, tp, stages)
        for r in runs:
            got = r["cases"][case]
            # Rank p's chunks are the stages p, p + pp, ... (Megatron's interleaved layout), and
            # each freshly built chunk holds exactly that stage's shard: tensors and shapes.
            assert sorted(got["init"]) == list(range(r["pp_rank"], stages, pp))
            for s, sd in got["init"].items():
                assert shapes(sd) == shapes(local[(r["tp_rank"], s)]), (case, r["tp_rank"], s)
        for d in range(4 // (tp * pp)):
            runs_d = [r for r in runs if r["dp_rank"] == d]

            def pieces(key):
                return {(r["tp_rank"], s): sd for r in runs_d for s, sd in r["cases"][case][key].items()}
            # Loaded into Megatron and read back, the pieces merge to the full weights bitwise.
            merged = ms.merge(pieces("loaded"), args, tp, stages)
            assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
            # At init Megatron's replicated norms agree over TP and, tied with PP > 1, its
            # last-stage embedding copy equals stage 0's (merge checks both bitwise).
            init = ms.merge(pieces("init"), args, tp, stages)
            if case[1] and pp > 1:
                last = torch.cat([pieces("init")[(t, stages - 1)]["output_layer.weight"] for t in range(tp)])
                assert torch.equal(last[:args.vocab_size], init["embedding.word_embeddings.weight"])


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_sharded_logits_match_tp1(dims, sharded_runs, full_states, layout):
    pp = layout[1]
    for case in CASES:
        args = case_args(*case)
        model = build_gpt_model(args, dims, torch.float64, seed=0)
        load_state(model, full_states[case])
        with torch.no_grad():
            want = gpt_logits(model, case_inputs(args))
        assert want.shape == (3, 11, args.vocab_size)
        for r in sharded_runs[layout]:
            got = r["cases"][case]["logits"]
            if r["pp_rank"] != pp - 1:
                assert got is None  # only the last stage returns logits
                continue
            assert got.shape == want.shape and got.dtype == torch.float64
            assert (got - want).abs().max().item() <= 1e-10, (case, r["tp_rank"], r["pp_rank"])


@pytest.mark.multiproc
def test_tp2_gradients_through_gathered_logits_match_tp1(dims, sharded_runs, full_states):
    """The TP gather's backward (each rank keeps its vocab slice) gives every rank the pieces of
    the TP=1 gradients: merged, they equal the TP=1 model's gradients."""
    tp, pp = 2, 1
    for case in CASES:
        args = case_args(*case)
        model = build_gpt_model(args, dims, torch.float64, seed=0)
        load_state(model, full_states[case])
        logits_loss(gpt_logits(model, case_inputs(args))).backward()
        want = {k: p.grad for k, p in model.named_parameters()}
        for d in range(2):
            pieces = {(r["tp_rank"], r["pp_rank"]): r["cases"][case]["grads"]
                      for r in sharded_runs[(tp, pp, 1)] if r["dp_rank"] == d}
            got = ms.merge(pieces, args, tp, pp)
            assert got.keys() == want.keys()
            for k, w in want.items():
                assert (got[k] - w).abs().max().item() <= 1e-9 * max(1.0, w.abs().max().item()), (case, k)


@pytest.fixture(scope="module")
def tp1_training(dims):
    """Per case: TP=1, PP=1, DP=1 training on the whole batch (the reference of the layouts)."""
    out = {}
    for case in CASES:
        args = case_args(*case)
        trainer = Trainer(args, train_config(), dims,
                          hf_state=reference(args, seed=3, dtype=torch.float64).hf_state_dict(), seed=0)
        out[case] = {"train": train_steps(trainer, args), "trained_hf": trainer.hf_state_dict()}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_sharded_training_matches_tp1(sharded_runs, tp1_training, layout):
    """Trainer steps through Megatron's schedules (1F1B for PP=2, interleaved 1F1B over the model
    chunks with virtual stages), vocab-parallel logprobs and
    DP-summed gradients: on every rank the old logprobs, the loss and metrics, the grad norm and
    the weights after 2 GRPO steps equal the single-process run (fp64; issue bound 1e-6)."""
    for case in CASES:
        want = tp1_training[case]
        for r in sharded_runs[layout]:
            got = r["cases"][case]
            for step in range(TRAIN_STEPS):
                g, w = got["train"][step], want["train"][step]
                assert (g["old_logprobs"] - w["old_logprobs"]).abs().max().item() <= 1e-10, (case, step)
                assert g["metrics"].keys() == w["metrics"].keys()
                for k, v in w["metrics"].items():
                    # Megatron sums the squared grad norm in fp32 whatever the grad dtype, so the
                    # norm agrees to fp32 precision only (the bound); the rest is fp64.
                    tol = 1e-6 if k == "grad_norm" else 1e-9
                    assert abs(g["metrics"][k] - v) <= tol * max(1.0, abs(v)), (case, step, k, g["metrics"][k], v)
                assert g["metrics"]["update_ok"] == 1.0
            assert got["trained_hf"].keys() == want["trained_hf"].keys()
            moved = max((want["trained_hf"][k] - v).abs().max().item()
                        for k, v in reference(case_args(*case), seed=3, dtype=torch.float64).hf_state_dict().items())
            assert moved > 1e-3  # the steps changed the weights: the comparison below means something
            diff = max((got["trained_hf"][k] - v).abs().max().item() for k, v in want["trained_hf"].items())
            assert diff <= 1e-9, (case, layout, diff)
