"""Resume checks (megarl/resume.py, docs/design.md §5): a checkpoint that cannot serve the run is
refused once, by name, before the run writes or builds anything, whoever starts it."""
import pytest
import torch

from megarl.checkpoint.rl_state import save_checkpoint
from megarl.config import load_config
from megarl.resume import check_checkpoint_fits
from megarl.run_dir import RunDirError


def _kl_run(tmp_path, kl_coef: float):
    return load_config("configs/smoke.yaml", [f"grpo.kl_coef={kl_coef}"]), tmp_path / "run"


def test_a_kl_run_resumes_only_from_a_checkpoint_holding_the_reference(tmp_path):
    cfg, run_dir = _kl_run(tmp_path, 0.1)
    without = save_checkpoint(run_dir, 2, {"w": torch.zeros(2)}, {"step": 2})
    with pytest.raises(RunDirError, match="holds no reference policy .* resume with grpo.kl_coef=0"):
        check_checkpoint_fits(without, cfg)
    check_checkpoint_fits(without, load_config("configs/smoke.yaml", ["grpo.kl_coef=0"]))
    with_ref = save_checkpoint(run_dir, 3, {"w": torch.zeros(2)}, {"step": 3}, ref_state={"w": torch.ones(2)})
    check_checkpoint_fits(with_ref, cfg)
    # step 0 (after SFT) holds no reference: the run takes the policy it starts from
    check_checkpoint_fits(save_checkpoint(tmp_path / "fresh", 0, {"w": torch.zeros(2)}, {"step": 0}), cfg)


def test_train_refuses_the_checkpoint_before_it_writes_anything(tmp_path, monkeypatch):
    """train() called directly (not through the CLI, which checks first) refuses the same
    checkpoint before it writes config.yaml or sets up any process group."""
    from megarl import train as train_mod

    def no_setup(**kw):
        raise AssertionError("the run set up its process groups")

    monkeypatch.setattr(train_mod, "init_distributed", no_setup)
    cfg, run_dir = _kl_run(tmp_path, 0.1)
    save_checkpoint(run_dir, 2, {"w": torch.zeros(2)}, {"step": 2})
    with pytest.raises(RunDirError, match="holds no reference policy"):
        train_mod.train(cfg, run_dir, resume=True)
    assert not (run_dir / "config.yaml").exists()
