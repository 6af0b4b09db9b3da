"""``trainer.dtype: bfloat16``: Megatron's mixed precision (bf16 weights and matmuls, fp32 master
weights, fp32 gradients reduced in fp32, fp32 logprobs and loss) trains like fp32 within bf16
rounding, resumes bitwise, and syncs bf16 weights into the engine."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.init_weights import init_hf_state
from megarl.models.llama import CausalLM
from megarl.parallel.checksum import tensor_checksum
from megarl.parallel.weight_sync import WeightSync
from megarl.trainer.trainer import Trainer, TrainerConfig

from .test_trainer import make_batch, nll_loss


def fp32_loss(logprobs, mb):
    assert logprobs.dtype == torch.float32, logprobs.dtype  # the loss is computed in fp32
    return nll_loss(logprobs, mb)


def start(args, seed=3):
    """The same starting weights for both dtypes: drawn once, rounded to bf16."""
    return {k: v.to(torch.bfloat16) for k, v in init_hf_state(args, seed, torch.float32).items()}


def masters(trainer):
    """The optimizer's fp32 master weights by Megatron name."""
    return {n: p.main_param for n, p in trainer.gpt.named_parameters()}


def test_bf16_step_matches_fp32_within_bf16_rounding(dims, make_args):
    args = make_args("qwen2")
    hf = start(args)
    cfg = dict(lr=1e-3, micro_batch_size=4)
    t32 = Trainer(args, TrainerConfig(**cfg), dims, hf_state={k: v.float() for k, v in hf.items()})
    t16 = Trainer(args, TrainerConfig(**cfg, dtype="bfloat16"), dims, hf_state=hf)
    before = {n: p.detach().clone() for n, p in t32.gpt.named_parameters()}
    batch = make_batch(args)
    for _ in range(3):
        m32, m16 = t32.train_step(batch, nll_loss), t16.train_step(batch, fp32_loss)
        assert m16["update_ok"] == 1.0
        assert abs(m16["loss"] - m32["loss"]) < 2e-3 * abs(m32["loss"])
        assert abs(m16["grad_norm"] - m32["grad_norm"]) < 5e-3 * m32["grad_norm"]
    # the master weights moved like the fp32 weights: the update's error is bf16's, far below its size
    main = masters(t16)
    err = sum(((main[n] - p.detach()) ** 2).sum() for n, p in t32.gpt.named_parameters()).sqrt()
    size = sum(((p.detach() - before[n]) ** 2).sum() for n, p in t32.gpt.named_parameters()).sqrt()
    assert err < 0.05 * size, (float(err), float(size))


def test_bf16_weights_fp32_masters_and_grads(dims, make_args):
    args = make_args("llama", tie=True)
    t16 = Trainer(args, TrainerConfig(lr=1e-3, micro_batch_size=4, dtype="bfloat16"), dims, hf_state=start(args))
    batch = make_batch(args)
    t16.train_step(batch, fp32_loss)
    for name, p in t16.gpt.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert p.main_grad.dtype == torch.float32, name  # accumulated and reduced in fp32
        assert p.main_param.dtype == torch.float32, name
        assert torch.equal(p.detach(), p.main_param.to(torch.bfloat16)), name  # the weights are the masters rounded
    assert any(not torch.equal(p.main_param, p.detach().float()) for p in t16.gpt.parameters()), \
        "the masters hold more than bf16 precision"
    lp = t16.masked_logprobs(batch["input_ids"], batch["loss_mask"])
    assert lp.dtype == torch.float32


def test_bf16_checkpoint_resume_is_bitwise(dims, make_args):
    args = make_args("qwen2")
    cfg = TrainerConfig(lr=5e-3, weight_decay=0.1, micro_batch_size=4, dtype="bfloat16")
    batches = [make_batch(args, seed=s) for s in range(3)]
    run = Trainer(args, cfg, dims, hf_state=start(args))
    run.train_step(batches[0], nll_loss)
    run.train_step(batches[1], nll_loss)
    ckpt = run.state_dict()
    run.train_step(batches[2], nll_loss)
    want, want_main = run.hf_state_dict(), masters(run)

    resumed = Trainer(args, cfg, dims, hf_state=start(args, seed=99))
    resumed.load_state_dict(ckpt)
    resumed.train_step(batches[2], nll_loss)
    got, got_main = resumed.hf_state_dict(), masters(resumed)
    for k in want:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]), k
    for k in want_main:
        assert torch.equal(got_main[k], want_main[k]), k


def test_bf16_weight_sync_sends_bf16(dims, make_args):
    args = make_args("qwen2")
    trainer = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=3, dtype="bfloat16"), dims,
                      hf_state=start(args))
    engine = Engine(CausalLM(args), EngineConfig(max_batch_size=4, max_seq_len=32, dtype="bfloat16"), seed=0)
    sync = WeightSync(trainer, engine)
    trainer.train_step(make_batch(args), nll_loss)
    info = sync()
    hf = trainer.hf_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in hf.values())
    assert all(engine.model.state_dict()[k].dtype == torch.bfloat16 for k in hf)
    assert tensor_checksum(engine.model.state_dict()) == tensor_checksum(hf)
    assert info["weight_sync_bytes"] == sum(t.numel() * 2 for t in hf.values())


def _sampled(engine, vocab, n=6):
    """n responses of the bf16 engine at T=1 (prompts of 2-9 tokens, up to 30 new): token ids
    [n, T] right padded, the response mask [n, T-1] and the engine's logprobs there."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (2 + 7 * i // (n - 1),), generator=g).tolist() for i in range(n)]
    outs = engine.generate([Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=30))
                            for i, p in enumerate(prompts)], step=1)
    width = max(len(p) + len(o.tokens) for p, o in zip(prompts, outs))
    ids, mask, lp = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width - 1), torch.zeros(n, width - 1)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ids[i, :len(p) + len(o.tokens)] = torch.tensor(p + list(o.tokens))
        mask[i, len(p) - 1:len(p) + len(o.tokens) - 1] = 1
        lp[i, len(p) - 1:len(p) + len(o.tokens) - 1] = torch.tensor(o.logprobs)
    return ids, mask, lp


@pytest.mark.parametrize("arch", [dict(model_type="qwen2"), dict(model_type="llama", tie=True),
                                  dict(model_type="qwen2", sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"])])
@pytest.mark.parametrize("packed", [False, True])
def test_bf16_eager_trainer_scores_the_engines_logprobs_bitwise(dims, make_args, arch, packed):
    """With ``trainer.attention: eager`` the bf16 trainer computes what the bf16 engine sampled
    with, bit for bit (same norm, linears, attention math): the on-policy gap is 0, also with
    packed micro-batches and sliding windows. torch's SDPA rounds elsewhere: there it is not."""
    args = make_args(**arch)
    engine = Engine(CausalLM(args), EngineConfig(max_batch_size=6, max_seq_len=48, dtype="bfloat16"), seed=0)
    g = torch.Generator().manual_seed(1)
    hf = {k: (v * (1 + torch.randn(v.shape, generator=g) / 4).to(v.dtype)) if "norm" in k else v  # not 1:
          for k, v in start(args).items()}  # a norm weight of 1 would hide a second rounding
    gaps = {}
    for attention in ("eager", "sdpa"):
        cfg = TrainerConfig(micro_batch_size=4, micro_batch_tokens=40 if packed else 0, dtype="bfloat16",
                            attention=attention)
        trainer = Trainer(args, cfg, dims, hf_state=hf)
        WeightSync(trainer, engine)()
        ids, mask, engine_lp = _sampled(engine, args.vocab_size)
        gaps[attention] = (trainer.masked_logprobs(ids, mask) - engine_lp)[mask.bool()].abs().max()
    assert gaps["eager"] == 0, gaps
    assert gaps["sdpa"] > 0, gaps


def test_bf16_is_a_valid_dtype():
    assert TrainerConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        TrainerConfig(dtype="float16")
    with pytest.raises(ValueError, match="trainer.attention='flash'.*'sdpa', 'eager'"):
        TrainerConfig(attention="flash")


@pytest.mark.parametrize("sharded", [False, True])
def test_bf16_optimizer_reset_keeps_the_masters(dims, make_args, sharded):
    """SFT -> RL resets the optimizer: the moments go, the fp32 master weights stay (not re-derived
    from the bf16 weights, which would round them)."""
    args = make_args("qwen2")
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=4, dtype="bfloat16", distributed_optimizer=sharded)
    trainer = Trainer(args, cfg, dims, hf_state=start(args))
    for s in range(2):
        trainer.train_step(make_batch(args, seed=s), nll_loss)
    before = trainer.master_weights()
    assert before and any(not torch.equal(m, p.detach().float().reshape(-1)[:m.numel()].reshape(m.shape))
                          for p, m in before.items())  # they hold more than the bf16 weights
    trainer.reset_optimizer()
    after = trainer.master_weights()
    assert after.keys() == before.keys() and all(torch.equal(after[p], before[p]) for p in before)
    assert not any(opt.optimizer.state for opt in trainer._optimizers())  # the moments are gone
