"""The memory plan's activation bytes (megarl/plan/activations.py) are what megarl's Megatron
trainer keeps for the backward: per layer and token, and per scored token, for every recompute
mode, fp32 and bf16, TP=1 (the saved-tensor hooks of tests/trainer/test_recompute.py)."""
import pytest
import torch

from megarl.models.config import ModelArgs
from megarl.plan.activations import eager_attention_bytes_per_token, head_bytes_per_scored_token, layer_bytes_per_token
from megarl.trainer.trainer import Trainer, TrainerConfig

from .test_recompute import saved_activation_bytes
from .test_trainer import nll_loss  # noqa: F401 (the loss saved_activation_bytes trains with)

ROWS, WIDTH = 4, 48


def _args(layers: int) -> ModelArgs:
    return ModelArgs(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", max_position_embeddings=128)


def _batch(scored: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (ROWS, WIDTH), generator=g)
    mask = torch.zeros(ROWS, WIDTH - 1)
    mask[:, WIDTH - 1 - scored:] = 1
    return {"input_ids": ids, "loss_mask": mask, "num_tokens": mask.sum()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_plan_activation_bytes_are_the_saved_tensors(dims, dtype, recompute):
    kept = {}
    for layers, scored in ((2, 8), (4, 8), (2, 24)):
        tr = Trainer(_args(layers), TrainerConfig(micro_batch_size=ROWS, dtype=dtype, recompute=recompute), dims,
                     seed=1)
        kept[layers, scored] = saved_activation_bytes(tr, _batch(scored))
    per_layer = (kept[4, 8] - kept[2, 8]) / 2 / (ROWS * WIDTH)
    per_scored = (kept[2, 24] - kept[2, 8]) / (ROWS * 16)
    # (selective: Megatron's checkpoint keeps a 1-element RNG-state tensor per layer, 1/tokens bytes)
    assert per_layer == pytest.approx(layer_bytes_per_token(_args(2), 1, dtype, recompute), abs=0.1)
    # the fp32 log-softmax copy over the vocabulary and the output layer's input, plus the few
    # per-position scalars of the loss (max, sum, target index, mask: under 40 bytes)
    assert 0 <= per_scored - head_bytes_per_scored_token(_args(2), 1, dtype) < 40


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_plan_counts_the_eager_attentions_probabilities(dims, dtype, recompute):
    """``trainer.attention: eager`` keeps [heads, L, L] probabilities per row and layer (none of
    them with recompute): the plan's term is at most 300 bytes per token above what autograd keeps."""
    kept = {}
    for layers in (2, 4):
        cfg = TrainerConfig(micro_batch_size=ROWS, dtype=dtype, recompute=recompute, attention="eager")
        kept[layers] = saved_activation_bytes(Trainer(_args(layers), cfg, dims, seed=1), _batch(8))
    per_layer = (kept[4] - kept[2]) / 2 / (ROWS * WIDTH)
    planned = layer_bytes_per_token(_args(2), 1, dtype, recompute)
    if recompute == "none":
        planned += eager_attention_bytes_per_token(_args(2), 1, dtype, WIDTH)
        # SDPA's count would be short by more than 2 bytes per head and key
        assert per_layer > layer_bytes_per_token(_args(2), 1, dtype, recompute) + 2 * 4 * WIDTH
    # (selective: Megatron's checkpoint keeps a 1-element RNG-state tensor per layer)
    assert -0.1 <= planned - per_layer < 300, (planned, per_layer)
