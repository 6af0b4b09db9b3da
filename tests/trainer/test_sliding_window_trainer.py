"""The Megatron trainer's GPTModel with sliding-window attention (Megatron's window_size and
window_attn_skip_freq, applied by megarl's SDPA attention) against transformers, over several windows;
the training path (packed and padded rows) with windows and with scaled RoPE."""
import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models.hf_io import load_hf_model
from megarl.trainer.model import build_gpt_model, gpt_logits
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.models.test_rope_scaling import ROPES
from tests.models.test_sliding_window import WINDOW, hf_model
from tests.trainer.test_trainer import causal_lm_from, cpu_fp64_trainer, make_batch, ref_logprobs


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mixtral"])
def test_trainer_logits_match_transformers(tmp_path, dims, family):
    hf = hf_model(family, seed=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_model(tmp_path / "hf", torch.float32)  # HF 5's fused experts under megarl's names
    args = ours.args
    assert args.sliding_window == WINDOW
    model = build_gpt_model(args, dims, torch.float32, seed=0)
    missing, unexpected = model.load_state_dict(mm.hf_to_mcore(ours.hf_state_dict(), args), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    ids = torch.randint(0, args.vocab_size, (2, 6 * WINDOW), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (gpt_logits(model, ids).cpu() - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@cpu_fp64_trainer
@pytest.mark.parametrize("extra", [
    dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    dict(rope_scaling={**ROPES["yarn_mscale"], "original_max_position_embeddings": 4}),
    dict(rope_scaling={**ROPES["llama3"], "original_max_position_embeddings": 8}),
], ids=["sliding_window", "yarn", "llama3"])
def test_trainer_packed_and_padded_logprobs_match_causal_lm(dims, make_args, extra):
    """The training path (Trainer, packed THD rows and right-padded rows, fp64) with rows of 5..10
    tokens, longer than the window and than the original RoPE context: the plain model's logprobs."""
    args = make_args("qwen2", **extra)
    tr = Trainer(args, TrainerConfig(micro_batch_size=4, dtype="float64"), dims, seed=2)
    batch = make_batch(args)
    assert batch["input_ids"].shape[1] > 8
    want = ref_logprobs(causal_lm_from(tr, args, torch.float64), batch["input_ids"]) * batch["loss_mask"]
    for pack in (True, False):
        tr.pack = pack
        got = tr.masked_logprobs(batch["input_ids"], batch["loss_mask"])
        assert (got - want).abs().max().item() <= 1e-12, pack
