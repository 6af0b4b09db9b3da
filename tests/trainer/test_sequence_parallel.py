"""``parallel.sequence_parallel``: Megatron's sequence parallelism in the trainer changes no weight
and no logprob beyond rounding (TP=2 on 2 gloo processes, fp64 and fp32), the micro-batches are
padded to a length that splits over TP, and TP=1 is refused with one line."""
from pathlib import Path

import pytest
import torch

from megarl.trainer.micro_batches import micro_batches, model_input, row_lengths

from tests.torchrun import torchrun
from .shard_worker import CASES, TRAIN_STEPS, case_args, train_batch
from .sp_worker import DTYPES

# Rounding level of each dtype after 2 Adam steps at lr 1e-2, which move the weights by ~2e-2; a
# layernorm gradient not summed over TP or an output-layer gradient summed twice moves them by
# ~1e-2. fp64 is the sharp check (measured: 1e-14); in fp32 Adam's normalised step turns a
# last-bit gradient difference of a near-zero component into a larger one (measured: 2e-5).
WEIGHT_TOL = {"float64": 1e-12, "float32": 1e-4}
LOGPROB_TOL = {"float64": 1e-12, "float32": 1e-5}


@pytest.fixture(scope="module")
def converted(dims, tmp_path_factory):
    """A tiny HF model and its ``megarl convert hf-to-torch-dist`` folder (written at TP=1)."""
    from megarl.trainer.dist_convert import hf_to_torch_dist
    from tests.checkpoint.test_convert import make_hf

    root = tmp_path_factory.mktemp("converted")
    hf = make_hf("qwen2", root / "hf")
    return hf, hf_to_torch_dist(hf, root / "td", dims=dims)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, converted):
    out = tmp_path_factory.mktemp("sequence_parallel")
    torchrun(Path(__file__).parent / "sp_worker.py", 2, str(out), str(converted[1]))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_the_batches_need_padding():
    """The worker's micro-batches (2 rows, packed) include odd token counts, so the padding to a
    multiple of TP=2 is exercised, and the scored positions are the same with and without it."""
    batch = train_batch(case_args(*CASES[0]), 0)
    odd = 0
    for mb in micro_batches(batch, 2):
        plain, padded = model_input(mb, True), model_input(mb, True, multiple=2)
        odd += plain.input_ids.shape[1] % 2
        assert padded.input_ids.shape[1] % 2 == 0 and padded.input_ids.shape[1] - plain.input_ids.shape[1] <= 1
        assert torch.equal(padded.input_ids[:, :plain.input_ids.shape[1]], plain.input_ids)
        assert torch.equal(padded.select, plain.select) and padded.cu_seqlens[-1] == padded.input_ids.shape[1]
        assert torch.equal(padded.cu_seqlens[:-1], plain.cu_seqlens[:-1])
    assert odd > 0
    right = model_input({"input_ids": batch["input_ids"][:3, :7]}, False, multiple=4)
    assert right.input_ids.shape == (3, 8) and not right.input_ids[:, 7].any()
    assert int(row_lengths(batch).sum()) > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_parallel_changes_no_weight(sp_runs, dtype):
    """Two GRPO steps at TP=2 with sequence parallelism end at the weights of TP=2 without it, with
    the same old logprobs, losses and grad norms on the way, and the trained models give the same
    logprobs (masked and of every position), on both TP ranks."""
    for rank in sp_runs:
        off, on = rank[(dtype, False)], rank[(dtype, True)]
        for case in CASES:
            a, b = off[case], on[case]
            for step in range(TRAIN_STEPS):
                diff = (a["train"][step]["old_logprobs"] - b["train"][step]["old_logprobs"]).abs().max().item()
                assert diff <= LOGPROB_TOL[dtype], (case, step, diff)
                for k in ("loss", "grad_norm"):
                    x, y = a["train"][step]["metrics"][k], b["train"][step]["metrics"][k]
                    assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (case, step, k, x, y)
            assert a["trained_hf"].keys() == b["trained_hf"].keys()
            diff = max((a["trained_hf"][k] - v).abs().max().item() for k, v in b["trained_hf"].items())
            assert diff <= WEIGHT_TOL[dtype], (case, dtype, diff)
            for key in ("logprobs", "all_logprobs"):
                assert a[key].shape == b[key].shape
                diff = (a[key] - b[key]).abs().max().item()
                assert diff <= LOGPROB_TOL[dtype], (case, key, diff)
    # the steps moved the weights: equal weights above mean the same update, not no update
    first = sp_runs[0][(dtype, True)][CASES[0]]
    assert first["train"][0]["metrics"]["grad_norm"] > 1e-2


def test_sequence_parallel_needs_tp2():
    from megarl.parallel.dist import init_parallel
    from megarl.parallel.layout import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel.sequence_parallel=true .* needs parallel.trainer_tp >= 2 "
                                         r"\(got trainer_tp=1\)"):
        ParallelConfig(sequence_parallel=True)
    ParallelConfig(sequence_parallel=True, trainer_tp=2)
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* needs tp >= 2 \(got tp=1\)"):
        init_parallel(tp=1, sequence_parallel=True)


@pytest.mark.multiproc
def test_tp2_trainer_starts_from_a_converted_torch_dist_folder(sp_runs, converted):
    """model.init_from_mcore with a torch_dist folder converted at TP=1: a TP=2 trainer (sequence
    parallel) holds the HF weights bitwise (Megatron resharded them on load)."""
    from megarl.models.hf_io import load_hf_state_dict

    want = load_hf_state_dict(converted[0])
    for rank in sp_runs:
        got = rank["started_from_torch_dist"]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def sp_pp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_parallel_pp")
    torchrun(Path(__file__).parent / "sp_worker.py", 4, str(out), "-")
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.multiproc
def test_sequence_parallel_with_pipeline_stages(sp_pp_runs):
    """TP=2 x PP=2 (1F1B; the stages exchange [tokens / TP] activations): the same check in fp64."""
    for rank in sp_pp_runs:
        off, on = rank[("float64", False)], rank[("float64", True)]
        for case in CASES:
            a, b = off[case], on[case]
            for step in range(TRAIN_STEPS):
                diff = (a["train"][step]["old_logprobs"] - b["train"][step]["old_logprobs"]).abs().max().item()
                assert diff <= LOGPROB_TOL["float64"], (case, step, diff)
            diff = max((a["trained_hf"][k] - v).abs().max().item() for k, v in b["trained_hf"].items())
            assert diff <= WEIGHT_TOL["float64"], (case, diff)
            assert (a["logprobs"] - b["logprobs"]).abs().max().item() <= LOGPROB_TOL["float64"], case
