"""megarl/parallel/preempt.py: the signal flag, the record, the exit status; and a whole run in
this process stopped by SIGUSR1 mid-run, resumed, ending at the uninterrupted run's weights.
No Slurm needed (the Slurm job test is test_slurm_jobs.py)."""
import json
import os
import signal

import pytest
from safetensors.torch import load_file

from megarl.parallel.preempt import EXIT_CODE, RECORD_NAME, Preempted, PreemptSignals, handled_signals


def test_signal_sets_the_flag_and_leaving_raises_preempted(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    (tmp_path / RECORD_NAME).write_text("{}")  # an earlier stop's record
    with pytest.raises(Preempted) as info, PreemptSignals(record=tmp_path / RECORD_NAME) as p:
        assert not (tmp_path / RECORD_NAME).exists()  # a new run supersedes it
        assert not p.requested and not p.agree()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.requested and p.agree()  # one process: agreeing is the flag
        p.stop(7)
    assert info.value.code == EXIT_CODE == 75 and info.value.step == 7
    assert "SIGUSR1" in str(info.value)
    assert json.loads((tmp_path / RECORD_NAME).read_text()) == {"step": 7, "signal": "SIGUSR1", "exit_code": 75}
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored


def test_no_stop_no_exception_and_errors_pass_through():
    with PreemptSignals(signals=(signal.SIGUSR1, signal.SIGTERM)) as p:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: only a flag
        assert p.requested
    with pytest.raises(KeyError), PreemptSignals() as p:
        p.stop(1)
        raise KeyError("a real failure wins over the stop")


def test_torchrun_workers_keep_sigterm():
    """torchrun's agent SIGTERMs workers to tear down a failed run: they must die at once."""
    assert handled_signals({"TORCHELASTIC_RUN_ID": "x"}) == (signal.SIGUSR1,)
    assert handled_signals({}) == (signal.SIGUSR1, signal.SIGTERM)


# The same tiny fp64 run as tests/parallel_run_worker.py (real updates: a reward that varies in every group).
OVERRIDES = ["rl_steps=3", "checkpoint_every=0", "sft.steps=0", "progress=false", "model.hidden_size=32",
             "model.intermediate_size=64", "model.max_position_embeddings=96", "rollout.prompts_per_step=4",
             "rollout.group_size=3", "rollout.max_new_tokens=10", "rollout.max_batch_size=6",
             "rollout.dtype=float64", "trainer.dtype=float64", "trainer.micro_batch_size=2", "trainer.lr=0.01"]


def test_run_stopped_by_a_signal_resumes_to_the_uninterrupted_weights(tmp_path):
    from megarl.config import load_config
    from megarl.setup_run import prepare_inputs
    from megarl.train import train
    from tests.parallel_run_worker import CONFIG, length_reward

    cfg = load_config(CONFIG, OVERRIDES)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    inputs = prepare_inputs(cfg)
    inputs.reward_fn = length_reward
    train(cfg, tmp_path / "plain", inputs=inputs)

    calls = []

    def signalling_reward(problem, text):  # SIGUSR1 while step 2 scores its responses
        calls.append(1)
        if len(calls) == per_step + 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return length_reward(problem, text)

    inputs.reward_fn = signalling_reward
    with pytest.raises(Preempted) as info:
        train(cfg, tmp_path / "run", inputs=inputs)
    assert info.value.step == 2 and info.value.code == 75
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step_000002").is_dir() and not (run / "hf").exists()  # no export when stopped
    assert json.loads((run / RECORD_NAME).read_text())["step"] == 2
    inputs.reward_fn = length_reward
    train(cfg, run, resume=True, inputs=inputs)
    assert not (run / RECORD_NAME).exists()
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    a, b = load_file(tmp_path / "plain" / "hf" / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
