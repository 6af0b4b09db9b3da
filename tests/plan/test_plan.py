"""The memory plan (megarl/plan/): its numbers on hand-checkable cases, the `megarl plan` command,
and the refusal at the start of `megarl train`, which must never block a CPU run by default."""
import json

import pytest

from megarl.models.config import ModelArgs
from megarl.plan import params
from megarl.plan.advice import spec_from_run
from megarl.plan.memory import GIB, PlanSpec, optimizer_bytes_per_param, plan, trainer_terms
from tests.cli_runs import ROOT, megarl

QWEN7B = ROOT / "configs/models/qwen2.5-7b.json"
QWEN32B = ROOT / "configs/models/qwen2.5-32b.json"


def small(**kw) -> ModelArgs:
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, model_type="llama")
    return ModelArgs(**{**base, **kw})


def test_parameter_counts_by_hand_and_against_the_model():
    # llama (no biases), h=8, head_dim=4, 2 query heads, 1 KV head, ffn 16, vocab 10, untied:
    # per layer q,k,v (2+1+1)*4 rows x 8 = 128, o 8x8 = 64, two norms 16, MLP 3x8x16 = 384 -> 592;
    # two layers 1184, embedding and LM head 80 each, final norm 8 -> 1352.
    assert params.model_params(small()) == 1352
    from megarl.models.llama import CausalLM

    moe = small(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    for args in (small(), small(model_type="qwen2", tie_word_embeddings=True), small(model_type="qwen3"), moe):
        assert params.model_params(args) == sum(p.numel() for p in CausalLM(args).parameters()), args.model_type
    # EP=2: each rank holds half of every layer's experts (router and the rest whole)
    experts = 2 * 4 * 3 * 8 * 8
    assert params.stage_params(moe, 1, 1, ep=2).expert == experts // 2
    assert params.stage_params(moe, 1, 1, ep=2).dense + experts == params.model_params(moe)
    # Qwen2.5's published sizes: 7.62B and 32.8B parameters
    assert params.model_params(_qwen(QWEN7B)) == 7_615_616_512
    assert params.model_params(_qwen(QWEN32B)) == 32_763_876_352


def test_stage_params_split_the_model():
    args = small(num_hidden_layers=4)
    whole = params.stage_params(args, 1, 1).total
    assert sum(params.stage_params(args, 1, 2, stage=s).total for s in range(2)) == whole
    # TP=2 halves every matrix (the vocab padded to 2 x 128 rows); the 4 layers x 2 norms + the final norm stay whole
    tp2 = params.stage_params(args, 2, 1).total
    norms = 4 * 2 * 8 + 8
    assert tp2 == (whole - norms - 2 * 10 * 8) // 2 + norms + 2 * 128 * 8


@pytest.mark.parametrize("dtype,dist,want", [
    ("float32", False, (4, 4, 8)), ("float32", True, (4, 4, 2)), ("bfloat16", False, (2, 4, 12)),
    ("bfloat16", True, (2, 4, 3)), ("float64", False, (8, 8, 16))])
def test_bytes_per_parameter_each_optimizer_mode(dtype, dist, want):
    # Megatron's table: fp32 16 B/param (8 + 8/DP distributed), bf16 with fp32 grads 18 (6 + 12/DP)
    assert optimizer_bytes_per_param(dtype, dist, 4) == want
    args = small()
    s = PlanSpec(args=args, gpus=4, trainer_dtype=dtype, distributed_optimizer=dist, device="cpu")
    terms = {t.name: t.bytes for t in trainer_terms(s, {})}
    assert (terms["trainer weights"], terms["gradients"], terms["optimizer state"]) == tuple(1352 * w for w in want)


def test_activations_scale_with_micro_batch_and_recompute():
    s = PlanSpec(args=_qwen(QWEN7B), gpus=8, seq_len=4096, response_len=3584, micro_batch_size=1)
    per_token = {}
    trainer_terms(s, per_token)
    none = per_token["per micro-batch token"]
    # bf16, TP=1, per layer and token: fp32 norms 2 x (8h + 4), linear inputs 2 x (2h + dq), rope and
    # qkv 2 x (4 d + 2 dq + 3 dkv), core attention 2 x (dq + 2 dkv + dq) + 4 heads + 8, MLP 2 x 5 ffn
    h, d, dq, dkv, ffn = 3584, 128, 3584, 512, 18944
    layer = 2 * (8 * h + 4) + 2 * (2 * h + dq) + 2 * (4 * d + 2 * dq + 3 * dkv) + 2 * (2 * dq + 2 * dkv) + 4 * 28 + 8 \
        + 2 * 5 * ffn
    assert none == 28 * layer
    trainer_terms(s.replace(recompute="full"), per_token)
    assert per_token["per micro-batch token"] == 28 * 2 * h  # each layer's bf16 input only
    act = {mbs: {t.name: t.bytes for t in trainer_terms(s.replace(micro_batch_size=mbs), {})} for mbs in (1, 2)}
    key = "activations (peak micro-batch)"
    head = 4 * 152064 + 2 * h
    assert act[2][key] - act[1][key] == pytest.approx(4096 * none + 3584 * (head + (8 + 2 + 4) * 152064))


def _qwen(path) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads(path.read_text()))


def test_qwen_layouts_that_fit_and_that_do_not():
    from megarl.config import load_config

    cfg = load_config(None, ["trainer.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.max_new_tokens=4096",
                             "trainer.micro_batch_size=1", "trainer.recompute=full"])
    s7 = spec_from_run(cfg, _qwen(QWEN7B), 8, 4608, "cuda", 3.0)
    assert not plan(s7).fits(80)  # 18 B/param of 7.6B on every GPU: the optimizer state alone is 85 GiB
    assert plan(s7.replace(distributed_optimizer=True, tp=2)).fits(80)
    s32 = spec_from_run(cfg, _qwen(QWEN32B), 64, 4608, "cuda", 3.0).replace(distributed_optimizer=True)
    assert not plan(s32).fits(80)
    assert plan(s32.replace(tp=8, rollout_tp=4)).fits(80)


def test_plan_command_prints_the_table_and_says_whether_it_fits(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(QWEN7B), "--gpus", "8", "--set", "trainer.dtype=bfloat16",
            "--set", "trainer.distributed_optimizer=true", "--set", "parallel.trainer_tp=2",
            "--set", "trainer.recompute=full", "--set", "trainer.micro_batch_size=1", "--set", "rollout.dtype=bfloat16"]
    ok = megarl(*args, "--json", str(out))
    assert "fits:" in ok.stdout and "optimizer state" in ok.stdout and "KV cache" in ok.stdout
    figures = json.loads(out.read_text())
    # 7.6B / TP=2 in bf16 with fp32 grads and 12 B/param sharded over DP=4
    terms = figures["per_gpu"]["every GPU"]["terms"]
    stage = params.stage_params(_qwen(QWEN7B), 2, 1).total
    assert terms["trainer weights"] == pytest.approx(2 * stage / GIB)
    assert terms["optimizer state"] == pytest.approx(3 * stage / GIB)
    bad = megarl(*args[:-2], "--set", "parallel.trainer_tp=1", "--gpu-memory-gb", "40", check=False)
    assert bad.returncode == 1 and "does not fit" in bad.stdout and "biggest term" in bad.stdout
    wrong = megarl("plan", "--model", str(tmp_path / "nope"), "--gpus", "8", check=False)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "--model" in wrong.stderr


def test_train_refuses_a_run_that_cannot_fit_before_writing(tmp_path):
    from megarl.config import load_config
    from megarl.plan.advice import _candidates, what_fits
    from megarl.setup_run import prepare_inputs

    # configs/tiny.yaml planned on 1 CPU process as the start plans it (its longest prompt + 320
    # tokens): a memory size the run misses but one change of its settings would meet
    cfg = load_config(ROOT / "configs/tiny.yaml")
    inputs = prepare_inputs(cfg)  # (no memory size on CPU: not checked here)
    spec = spec_from_run(cfg, inputs.args, 1, inputs.max_seq_len, "cpu", cfg.memory.reserve_gb)
    need, fixed = plan(spec).peak()[1], min(plan(c).peak()[1] for _, c in _candidates(spec))
    device = (need + fixed) / 2 / GIB
    run_dir = tmp_path / "run"
    proc = megarl("train", "--config", "configs/tiny.yaml", "--run-dir", str(run_dir),
                  "--set", f"memory.device_memory_gb={device}", "--set", "sft.steps=0", "--set", "rl_steps=0",
                  check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    msg = proc.stderr.strip()
    assert msg.startswith("megarl: error: the memory plan needs") and "\n" not in msg
    assert "the biggest term is" in msg and "it would fit with" in msg
    assert not run_dir.exists()  # refused before anything was written
    fix = msg.split("it would fit with ")[1].split(" (")[0]
    assert fix in [k for k, _ in what_fits(spec, device)]


def test_check_skips_cpu_runs_without_a_memory_size(monkeypatch):
    import torch

    from megarl.config import load_config
    from megarl.plan.check import check_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, [])
    huge = _qwen(QWEN32B)
    check_memory(cfg, huge, 1, 4096)  # unknown memory: no check, whatever the model
    with pytest.raises(ValueError, match="memory.device_memory_gb=80"):
        check_memory(load_config(None, ["memory.device_memory_gb=80"]), huge, 1, 4096)
    check_memory(load_config(None, ["memory.device_memory_gb=80", "memory.check=false"]), huge, 1, 4096)
