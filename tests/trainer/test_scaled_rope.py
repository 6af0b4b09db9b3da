"""The Megatron trainer's GPTModel with scaled RoPE (HF rope_type llama3 / yarn) against transformers
and against megarl's CausalLM (megarl/models/rope.py; yarn's attention factor as a softmax scale)."""
import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.trainer.model import build_gpt_model, gpt_logits
from tests.models.test_rope_scaling import ROPES, hf_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_trainer_logits_match_transformers(dims, arch, rope):
    hf = hf_model(arch, ROPES[rope], seed=5)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    model = build_gpt_model(args, dims, torch.float32, seed=0)
    missing, unexpected = model.load_state_dict(mm.hf_to_mcore(hf.state_dict(), args), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    ids = torch.randint(0, args.vocab_size, (2, 100), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (gpt_logits(model, ids).cpu() - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("rope", ["llama3", "yarn_mscale"])
def test_trainer_matches_causal_lm_fp64(dims, rope):
    hf = hf_model("qwen2", ROPES[rope], seed=7)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    ref = CausalLM(args).to(torch.float64)
    ref.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    model = build_gpt_model(args, dims, torch.float64, seed=0)
    model.load_state_dict(mm.hf_to_mcore(ref.hf_state_dict(), args), strict=False)
    ids = torch.randint(0, args.vocab_size, (2, 90), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (gpt_logits(model, ids).cpu() - ref(ids)).abs().max().item() <= 1e-12
