"""Worker of test_tp_engine.py: run under torchrun on 2 gloo processes, asserts itself (a
failure exits non-zero, which the test reports with the output).

One launch does every check (starting processes costs more than the tiny models), all in fp64:
1. ``TPCausalLM`` hidden states and logits (over 2 ranks, and over a group of 1) equal the
   TP=1 ``CausalLM``'s (1e-12), for Qwen2
   (qkv bias, tied embeddings), Llama (untied), Llama with attention bias (o_proj bias) and,
   where megarl.models has it, Qwen3 (per-head q/k norms).
2. ``Engine.generate`` with TP=2 gives the TP=1 engine's responses token for token, with and
   without the speculator, over groups of 4 samples with T=1, top-k, top-p and greedy rows, more
   requests than slots (slots are refilled and compacted), and with the paged KV cache; the same
   tokens on both ranks.
   Weights load both ways: full HF tensors (each rank slices) and pre-sliced pieces.
3. Ranks given different steps fail on both ranks with a clear error instead of hanging.
"""
import copy
import dataclasses
import random
import time

import torch
import torch.distributed as dist

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.tp_model import TPCausalLM, tp_shard, tp_slice, vocab_range
from megarl.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from megarl.models.llama import CausalLM
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator

BASE = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=1)
VARIANTS = {"qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True),
            "llama_untied": dict(model_type="llama", vocab_size=41),  # uneven vocab pieces: 21 + 20 rows
            "llama_bias": dict(model_type="llama", attention_bias=True)}
if "qwen3" in SUPPORTED_ARCHITECTURES.values():  # Qwen3 support in megarl.models is newer than this test
    VARIANTS["qwen3"] = dict(model_type="qwen3")
SEED, STEP = 1234, 3


def reference_model(variant: str) -> CausalLM:
    """Seeded fp64 TP=1 model. The (tied or untied) LM head is scaled down so that T=1 samples
    vary (a tied N(0, 1) embedding mostly repeats the last token) and EOS made rare so that
    responses run to their length limit often, with siblings to draft from."""
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(**{**BASE, **VARIANTS[variant]})).double()
    with torch.no_grad():
        for name, p in model.named_parameters():  # random biases and norm gains: every tensor matters
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        model.lm_head_weight.mul_(0.2 if model.args.tie_word_embeddings else 0.5)
        model.lm_head_weight[BASE["eos_token_id"]] *= 0.2
    return model


def requests() -> list[Request]:
    rng = random.Random(0)
    kinds = [dict(temperature=1.0), dict(temperature=1.0, top_k=5), dict(temperature=0.8, top_p=0.8),
             dict(temperature=1.0, top_k=8, top_p=0.9), dict(temperature=0.0)]
    reqs = []
    for uid in range(5):  # one sampling setting per prompt, 4 samples each (a GRPO group)
        prompt = [rng.randrange(2, 40) for _ in range(rng.randint(2, 8))]
        params = SamplingParams(max_new_tokens=rng.randint(8, 16), stop_token_ids=(1,), **kinds[uid])
        reqs += [Request(uid, i, prompt, params) for i in range(4)]
    return reqs


def check_logits(group, solo, rank: int) -> None:
    ids = torch.tensor([[5, 17, 3, 39, 0, 22, 8], [1, 2, 3, 4, 5, 6, 7]])
    for variant in VARIANTS:
        ref = reference_model(variant)
        one = TPCausalLM(ref.args, solo).double()  # a group of one rank: the whole model, no collectives
        one.load_state_dict(tp_shard(ref.state_dict(), 0, 1))
        with torch.no_grad():
            assert (one(ids) - ref(ids)).abs().max().item() < 1e-12
        tp = TPCausalLM(ref.args, group).double()
        tp.load_state_dict(tp_shard(ref.state_dict(), rank, 2))
        assert tp.model.layers[0].self_attn.q_proj.weight.shape == (2 * 8, 32)  # 2 of 4 query heads
        assert tp.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)  # 1 of 2 KV heads
        assert tp.model.embed_tokens.weight.shape == (vocab_range(ref.args.vocab_size, rank, 2)[1], 32)
        with torch.no_grad():
            h_ref, h_tp = ref.hidden_states(ids), tp.hidden_states(ids)
            l_ref, l_tp = ref.logits(h_ref), tp.logits(h_tp)
        assert l_tp.shape == l_ref.shape == (2, 7, ref.args.vocab_size)
        dh, dl = (h_tp - h_ref).abs().max().item(), (l_tp - l_ref).abs().max().item()
        assert dh < 1e-12 and dl < 1e-12, (variant, dh, dl)
        if rank == 0:
            print(f"logits {variant}: max |hidden diff| {dh:.1e}, max |logit diff| {dl:.1e}", flush=True)


def gather(obj):
    out = [None, None]
    dist.all_gather_object(out, obj)
    return out


def check_engine(group, rank: int) -> None:
    reqs = requests()
    cfg = EngineConfig(max_batch_size=8, max_seq_len=32, dtype="float64")
    spec_cfg = SpecConfig(enabled=True, sources=("group", "prompt"), forward_cost_tokens=0)
    for variant in ("qwen2_tied", "llama_untied"):
        ref_model = reference_model(variant)
        full = ref_model.state_dict()
        ref = Engine(copy.deepcopy(ref_model), cfg, seed=SEED).generate(reqs, STEP)
        ref_keys = [(r.uid, r.sample_idx, r.tokens, r.finish_reason) for r in ref]
        assert len({tuple(r.tokens) for r in ref}) > len(reqs) // 2, "samples should differ"

        eng = Engine(TPCausalLM(ref_model.args, group), cfg, seed=SEED)
        assert eng.cache.k.shape[2] == 1  # this rank's KV heads only
        eng.load_weights(full)  # full tensors: the engine slices its own piece
        t0 = time.perf_counter()
        out = eng.generate(reqs, STEP)
        dt = time.perf_counter() - t0
        assert [(r.uid, r.sample_idx, r.tokens, r.finish_reason) for r in out] == ref_keys, variant
        for a, b in zip(out, ref):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-10

        if variant == "qwen2_tied":  # the paged cache: each rank's blocks hold its own KV heads
            paged = Engine(TPCausalLM(ref_model.args, group), dataclasses.replace(cfg, kv_cache="paged", kv_block_size=4),
                           seed=SEED)
            assert paged.cache.k.shape[2] == 1
            paged.load_weights(full)
            assert [(r.uid, r.sample_idx, r.tokens, r.finish_reason) for r in paged.generate(reqs, STEP)] == ref_keys

        spec_eng = Engine(TPCausalLM(ref_model.args, group), cfg, seed=SEED, spec=Speculator(spec_cfg))
        pieces = {k: tp_slice(k, v, rank, 2).contiguous() for k, v in full.items()}
        spec_eng.load_weights(pieces, sliced=True)  # what a per-rank weight sync sends
        spec_out = spec_eng.generate(reqs, STEP)
        assert [(r.uid, r.sample_idx, r.tokens, r.finish_reason) for r in spec_out] == ref_keys, variant
        m = spec_eng.spec.metrics()
        assert m["spec/accepted"] > 0 and m["spec/accepted"] < m["spec/drafted"], m  # accepts and rejects

        mine = [r.tokens for r in out] + [r.tokens for r in spec_out]
        both = gather(mine)
        assert both[0] == both[1] == mine  # both ranks: the same tokens
        if rank == 0:
            print(f"engine {variant}: {sum(len(r.tokens) for r in ref)} tokens identical to TP=1 "
                  f"(plain {dt:.2f}s, {eng.stats['forwards']} forwards; spec {spec_eng.stats['forwards']} "
                  f"forwards, {m['spec/accepted']:.0f}/{m['spec/drafted']:.0f} drafts accepted)", flush=True)


def check_group_mismatch(group, rank: int) -> None:
    model = reference_model("llama_untied")
    eng = Engine(TPCausalLM(model.args, group), EngineConfig(max_batch_size=2, max_seq_len=16, dtype="float64"),
                 seed=SEED)
    try:
        eng.generate(requests()[:2], step=rank)  # a caller bug: each rank another step
    except ValueError as e:
        assert "different requests, seeds or steps" in str(e), e
    else:
        raise AssertionError("ranks with different steps must fail")


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two cores
    group = dist.new_group([0, 1])  # the rollout group, passed explicitly
    solos = [dist.new_group([r]) for r in range(2)]  # new_group is collective: every rank makes each
    rank = dist.get_rank(group)
    t0 = time.perf_counter()
    check_logits(group, solos[rank], rank)
    check_engine(group, rank)
    check_group_mismatch(group, rank)
    if rank == 0:
        print(f"tp_worker OK in {time.perf_counter() - t0:.2f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
