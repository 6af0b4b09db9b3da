"""The CPU compatibility layer is scoped to Megatron's modules and idempotent."""
import pytest
import torch

from megarl.trainer import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only layer")


def test_install_is_idempotent_and_scoped(dims):
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.optimizer import clip_grads, optimizer

    assert cpu_compat.install() and cpu_compat.install()
    assert rotary_pos_embedding.torch is cpu_compat._cpu_torch
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    # inside the shim a CUDA device means CPU; the real torch is untouched
    assert rotary_pos_embedding.torch.zeros(2, device="cuda").device.type == "cpu"
    assert rotary_pos_embedding.torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is not cpu_compat._cpu_cuda.current_device


def test_clip_grads_on_cpu_fp64(dims):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.full((4,), 3.0, dtype=torch.float64)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5, dtype=torch.float64))
