"""The trainer's weights into the vLLM backend (megarl/engine/vllm_backend.py) through the weight
sync: after every sync vLLM's greedy tokens equal transformers' ``generate`` on the trainer's
exported weights, and vLLM's logprobs of its own samples equal the trainer's (fp32 rounding)."""
import torch

from megarl.engine import EngineConfig, Request, SamplingParams
from megarl.parallel.weight_sync import WeightSync
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.conftest import tiny_args
from tests.trainer.test_trainer import make_batch, nll_loss
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm

# head_dim 32: the smallest vLLM-CPU's attention takes
ARGS = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=128)


def _greedy_hf(folder, prompts, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def test_after_each_sync_vllm_greedy_equals_transformers_and_logprobs_equal_the_trainers(dims, tmp_path):
    from megarl.checkpoint.export import export_hf
    from megarl.engine.vllm_backend import VLLMEngine

    args = tiny_args("llama", tie=True, **ARGS)
    trainer = Trainer(args, TrainerConfig(lr=3e-2, micro_batch_size=6), dims, seed=4)
    engine = VLLMEngine(args, EngineConfig(max_batch_size=6, max_seq_len=64), seed=2, temperature=1.0)
    sync = engine.after_sync(WeightSync(trainer, engine))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 14)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    seen = []
    for step in range(2):
        if step:  # new weights: one optimizer step
            trainer.train_step(make_batch(args), nll_loss)
        assert sync()["vllm_load_s"] >= 0
        export_hf(trainer, tmp_path / f"hf{step}")
        tokens = [r.tokens for r in engine.generate([Request(i, 0, p, greedy) for i, p in enumerate(prompts)], step)]
        assert tokens == _greedy_hf(tmp_path / f"hf{step}", prompts, 16)
        seen.append(tokens)
        sampled = engine.generate([Request(i, s, p, SamplingParams(max_new_tokens=12))
                                   for i, p in enumerate(prompts) for s in range(2)], step)
        diff = 0.0
        for r in sampled:
            ids = torch.tensor([r.prompt_ids + r.tokens])
            lp = trainer.token_logprobs(ids)[0, len(r.prompt_ids) - 1:].double()
            diff = max(diff, (lp - torch.tensor(r.logprobs, dtype=torch.float64)).abs().max().item())
        assert diff < 1e-4, diff  # logprob_diff_max at fp32 rounding level (docs/design.md §1.3)
    assert seen[0] != seen[1]  # the step changed the weights, and vLLM generates from the new ones


def test_a_second_vllm_after_the_process_group_was_set_up_again(dims):
    """A vLLM started after torch.distributed's default group was destroyed and made again (a new
    run in the same process; a test after another) builds its groups anew instead of reusing the
    first vLLM's stale ones ("not initialized in the world group map")."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    from megarl.engine.vllm_backend import VLLMEngine

    args = tiny_args("llama", tie=True, **ARGS)
    VLLMEngine(args, EngineConfig(max_batch_size=2, max_seq_len=32), seed=0, temperature=1.0)
    stale = ps._WORLD
    assert stale is not None
    # what a teardown and a new set-up do between two runs: the default group is another one now
    pg_map = dist.distributed_c10d._world.pg_map
    saved = pg_map.pop(stale.device_group)
    try:
        engine = VLLMEngine(args, EngineConfig(max_batch_size=2, max_seq_len=32), seed=0, temperature=0.0)
        assert ps._WORLD is not stale
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        out = engine.generate([Request(0, 0, [1, 2, 3], params)], step=0)
        assert len(out[0].tokens) == 4
    finally:
        pg_map.setdefault(stale.device_group, saved)
