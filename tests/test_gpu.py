"""GPU checks of the foundation (skipped without CUDA): the engine on CUDA samples exactly what it
samples on CPU (fp64), and the Megatron trainer's CUDA path (no CPU compatibility layer) takes
the same optimizer step as on CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def tiny(seed=0):
    args = ModelArgs(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", eos_token_id=1)
    torch.manual_seed(seed)
    return args, CausalLM(args)


def requests():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(1,)),
              SamplingParams(temperature=0.7, top_k=5, max_new_tokens=30, stop_token_ids=(1,)),
              SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=50, stop_token_ids=(1,)),
              SamplingParams(temperature=0.0, max_new_tokens=20)]
    return [Request(uid=i, sample_idx=i % 3, prompt_ids=torch.randint(2, 40, (3 + i % 7,), generator=g).tolist(),
                    params=params[i % 4]) for i in range(16)]


def test_engine_cuda_equals_cpu_fp64():
    _, model = tiny()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cpu = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=128, dtype="float64"), seed=11)
    _, model2 = tiny()
    model2.load_state_dict(sd)
    gpu = Engine(model2, EngineConfig(max_batch_size=16, max_seq_len=128, dtype="float64", device="cuda"), seed=11)
    a = [r.tokens for r in cpu.generate(requests(), step=3)]
    b = [r.tokens for r in gpu.generate(requests(), step=3)]
    assert a == b


def test_trainer_cuda_step_matches_cpu(tmp_path):
    """One process per device: Megatron's parallel state is process-global."""
    outs = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / f"{dev}.pt"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if dev == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_trainer_worker.py"), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[dev] = torch.load(out)
    assert outs["cuda"]["device"].startswith("cuda") and outs["cpu"]["device"] == "cpu"
    for k, v in outs["cpu"]["weights"].items():
        diff = (v - outs["cuda"]["weights"][k]).abs().max().item()
        assert diff <= 1e-5, (k, diff)
    assert abs(outs["cpu"]["loss"] - outs["cuda"]["loss"]) <= 1e-5
