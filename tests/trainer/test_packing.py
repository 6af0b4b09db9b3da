"""Packed micro-batches (rows one after another without padding, THD, SDPA per row) and token-budget
micro-batches: the same logprobs and the same step as right-padded rows (fp64)."""
import pytest
import torch

from megarl.trainer.micro_batches import model_input, row_groups
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.trainer.test_trainer import causal_lm_from, cpu_fp64_trainer, make_batch, nll_loss, ref_logprobs


def test_row_groups_fill_the_token_budget():
    lengths = torch.tensor([5, 3, 9, 4, 20, 2])
    order = torch.tensor([5, 1, 3, 0, 2, 4])  # by length: 2, 3, 4, 5, 9, 20
    groups = row_groups(lengths, order, size=4, max_tokens=10)
    assert [g.tolist() for g in groups] == [[5, 1, 3], [0], [2], [4]]  # 9 | 5 (+9 > 10) | 9 | 20 alone
    assert [g.tolist() for g in row_groups(lengths, order, size=4)] == [[5, 1, 3, 0], [2, 4]]
    with pytest.raises(ValueError, match=r"trainer.micro_batch_tokens=-3 is invalid; valid range: >= 0"):
        TrainerConfig(micro_batch_tokens=-3)


def test_packed_model_input_layout():
    ids = torch.tensor([[7, 8, 9, 0], [4, 5, 0, 0]])
    mask = torch.tensor([[0, 1, 0], [1, 0, 0]])
    inp = model_input({"input_ids": ids, "loss_mask": mask}, pack=True)
    assert inp.input_ids.tolist() == [[7, 8, 9, 4, 5]] and inp.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert inp.cu_seqlens.tolist() == [0, 3, 5] and inp.max_seqlen == 3
    assert inp.select.tolist() == [1, 3] and inp.targets.tolist() == [9, 5]  # row 0 predicts 9 at 1, row 1 5 at 0
    assert inp.scatter(torch.tensor([1.0, 2.0]), 4).tolist() == [[0, 1, 0], [2, 0, 0]]


@cpu_fp64_trainer
@pytest.mark.parametrize("model_type,tie", [("qwen2", False), ("llama", True)])
def test_packed_and_padded_logprobs_agree_with_hf(dims, make_args, model_type, tie):
    """4 query heads over 2 kv heads (GQA); rows of lengths 5..10 in micro-batches of 4 and 2."""
    args = make_args(model_type, tie=tie)
    tr = Trainer(args, TrainerConfig(micro_batch_size=4, dtype="float64"), dims, seed=2)
    batch = make_batch(args)
    want = ref_logprobs(causal_lm_from(tr, args, torch.float64), batch["input_ids"]) * batch["loss_mask"]
    got = {}
    for pack in (True, False):
        tr.pack = pack
        got[pack] = tr.masked_logprobs(batch["input_ids"], batch["loss_mask"])
        assert (got[pack] - want).abs().max().item() <= 1e-12, pack
        full = tr.token_logprobs(batch["input_ids"])  # no mask: every position scored
        assert (full - ref_logprobs(causal_lm_from(tr, args, torch.float64), batch["input_ids"])).abs().max() <= 1e-12
    assert (got[True] - got[False]).abs().max().item() <= 1e-12


@cpu_fp64_trainer
def test_packed_padded_and_token_budget_take_the_same_step(dims, make_args):
    args = make_args("qwen2")
    batch = make_batch(args)
    runs = []
    for pack, tokens in ((False, 0), (True, 0), (True, 16)):
        tr = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=4, micro_batch_tokens=tokens, dtype="float64"),
                     dims, seed=5)
        tr.pack = pack
        seen = []
        real = tr._forward_backward
        tr._forward_backward = lambda mbs, fn, t=1.0: seen.append(len(mbs)) or real(mbs, fn, t)
        m = tr.train_step(batch, nll_loss)
        runs.append((m, tr.hf_state_dict(), seen))
    assert runs[2][2] != runs[1][2]  # the budget did cut other micro-batches (lengths 5..10, <= 16 tokens each)
    (m0, w0, _) = runs[0]
    for m, w, _ in runs[1:]:
        assert abs(m["loss"] - m0["loss"]) < 1e-12 and abs(m["grad_norm"] - m0["grad_norm"]) < 1e-9
        assert max((w[k] - w0[k]).abs().max().item() for k in w) < 1e-12
