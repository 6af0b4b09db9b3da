"""``megarl convert hf-to-torch-dist`` / ``torch-dist-to-hf`` (megarl/trainer/dist_convert.py):
HF -> torch_dist -> HF is bitwise (weights, config, tokenizer files), Megatron-core's own
``dist_checkpointing.load`` reads the converted folder into a Megatron GPTModel, a run's trainer
checkpoint converts to the trainer's HF weights, and bad input is refused before anything is
written."""
import json
import subprocess
import sys

import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_state_dict
from megarl.trainer import dist_convert as dc
from tests.checkpoint.test_convert import TOKENIZER, assert_same_tensors, dims, make_hf, nothing_at  # noqa: F401


@pytest.mark.parametrize("family,dtype", [("llama_tied", torch.float32), ("qwen2", torch.float32),
                                          ("qwen3", torch.bfloat16)])
def test_hf_to_torch_dist_to_hf_is_bitwise(dims, tmp_path, family, dtype):
    hf = make_hf(family, tmp_path / "hf", dtype=dtype)
    dc.hf_to_torch_dist(hf, tmp_path / "td", dims=dims)
    assert (tmp_path / "td" / "metadata.json").is_file() and (tmp_path / "td" / "tokenizer.json").is_file()
    dc.torch_dist_to_hf(tmp_path / "td", tmp_path / "back", dims=dims)
    want, got = load_hf_state_dict(hf), load_hf_state_dict(tmp_path / "back")
    if family == "llama_tied":
        want.pop("lm_head.weight", None)  # a tied model's head is its embedding (not saved twice)
    assert_same_tensors(got, want)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    for name, text in TOKENIZER.items():
        assert (tmp_path / "back" / name).read_text() == text


def test_megatron_core_alone_loads_the_converted_folder(dims, tmp_path):
    """Megatron-core only: ``dist_checkpointing.load`` into a GPTModel built with other weights
    gives the HF weights (Megatron names), and ``load_plain_tensors`` (no model at all) too."""
    from megatron.core import dist_checkpointing

    from megarl.trainer.model import build_gpt_model

    hf = make_hf("qwen2", tmp_path / "hf")
    dc.hf_to_torch_dist(hf, tmp_path / "td", dims=dims)
    args = ModelArgs.from_hf_config(json.loads((hf / "config.json").read_text()))
    want = mm.hf_to_mcore(load_hf_state_dict(hf), args)
    model = build_gpt_model(args, dims, torch.float32, seed=7)  # Megatron's own init: other weights
    assert not torch.equal(model.state_dict()["embedding.word_embeddings.weight"],
                           want["embedding.word_embeddings.weight"])
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tmp_path / "td"))
    model.load_state_dict(loaded["model"], strict=True)
    got = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert_same_tensors(got, want)
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path / "td"))
    # Megatron saves the layers stacked along a first axis, under Transformer Engine's norm names
    assert torch.equal(plain["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][1],
                       want["decoder.layers.1.input_layernorm.weight"])
    assert torch.equal(plain["decoder.layers.mlp.linear_fc2.weight"][0], want["decoder.layers.0.mlp.linear_fc2.weight"])
    assert torch.equal(plain["output_layer.weight"], want["output_layer.weight"])


def test_run_checkpoint_converts_to_hf(dims, make_trainer_folder):
    """A run's trainer checkpoint (trainer.checkpoint_format=torch_dist) converts to the trainer's
    HF weights, bitwise; it records its model's HF config, so no --hf-config is needed."""
    folder, trainer = make_trainer_folder
    out = folder.parent / "hf"
    dc.torch_dist_to_hf(folder, out, dims=dims)
    assert_same_tensors(load_hf_state_dict(out), trainer.hf_state_dict())


@pytest.fixture
def make_trainer_folder(dims, tmp_path):
    from megarl.trainer.dist_ckpt import save_trainer
    from megarl.trainer.trainer import Trainer, TrainerConfig
    from tests.conftest import tiny_args
    from tests.trainer.test_trainer import make_batch, nll_loss

    args = tiny_args("llama", tie=True)
    trainer = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=4), dims, seed=5)
    trainer.train_step(make_batch(args), nll_loss)
    (tmp_path / "trainer").mkdir()
    save_trainer(trainer, tmp_path / "trainer")
    return tmp_path / "trainer", trainer


def test_bad_input_is_refused_before_writing(dims, tmp_path):
    hf = make_hf("qwen2", tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="not a Megatron distributed checkpoint.*hf-to-torch-dist"):
        dc.torch_dist_to_hf(hf, tmp_path / "out", dims=dims)  # a HF folder is not a torch_dist one
    assert nothing_at(tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty; pass --force"):
        dc.hf_to_torch_dist(hf, tmp_path / "full", dims=dims)
    assert (tmp_path / "full" / "x").read_text() == "keep"
    (hf / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        dc.hf_to_torch_dist(hf, tmp_path / "td", dims=dims)
    assert nothing_at(tmp_path / "td")


def test_cli(tmp_path):
    """``megarl convert hf-to-torch-dist`` in its own process (a world of one of its own); the
    other direction through the same parser refuses the module's own entry point clearly."""
    from megarl.checkpoint.convert_cli import main_convert

    hf = make_hf("llama", tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", "hf-to-torch-dist", "--hf", str(hf),
                           "--out", str(tmp_path / "td")], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {tmp_path / 'td'}" in proc.stdout and (tmp_path / "td" / "metadata.json").is_file()
    with pytest.raises(ValueError, match="runs as `megarl convert torch-dist-to-hf`"):
        main_convert(["torch-dist-to-hf", "--ckpt", str(tmp_path / "td"), "--out", str(tmp_path / "back")])


def test_a_run_starts_from_the_converted_folder(dims, tmp_path):
    """model.init_from_mcore with a torch_dist folder: the run's model is the checkpoint's (its
    recorded HF config), the trainer starts at the HF weights bitwise, and a layout that cannot
    load it collectively is refused at start with the fix."""
    from pathlib import Path

    from megarl.config import load_config
    from megarl.setup_run import prepare_inputs
    from megarl.trainer.trainer import Trainer, TrainerConfig

    hf = make_hf("llama_tied", tmp_path / "hf")
    dc.hf_to_torch_dist(hf, tmp_path / "td", dims=dims)
    config = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    start = [f"model.init_from_mcore={tmp_path / 'td'}", "rollout.max_new_tokens=32"]  # (the model's 64 positions)
    args = prepare_inputs(load_config(config, start)).args
    assert args == ModelArgs.from_hf_config(json.loads((hf / "config.json").read_text()))
    trainer = Trainer(args, TrainerConfig(), dims, mcore_dir=str(tmp_path / "td"), seed=1)
    want = load_hf_state_dict(hf)
    want.pop("lm_head.weight", None)
    assert_same_tensors(trainer.hf_state_dict(), want)
    with pytest.raises(ValueError, match="torch_dist folder.*needs parallel.placement=colocated and "
                                         "parallel.trainer_vpp=1.*torch-dist-to-hf"):
        prepare_inputs(load_config(config, [*start, "parallel.trainer_pp=2", "parallel.trainer_vpp=2"]))
