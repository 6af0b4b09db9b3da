"""The ``rollout`` section of the run config: how responses are sampled, on which engine
(its dtype, device and KV-cache layout), how a step's prompts are spread over the replicas, and
whether the samples are dumped (docs/design.md §1: counter-based Gumbel sampling)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.engine.vllm_spec import VLLMSpecConfig


@dataclass
class RolloutConfig:
    """How responses are sampled (docs/design.md §1: counter-based Gumbel sampling)."""

    prompts_per_step: int = 8
    """Prompts (GRPO groups) per RL step."""
    group_size: int = 8
    """Samples per prompt (G)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables."""
    max_new_tokens: int = 256
    """Longest response; longer ones are cut (finish_reason=length)."""
    max_batch_size: int = 64
    """Requests decoded together (continuous batching)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Engine weights/activations dtype."""
    device: str = "cpu"
    """Engine device (``cpu`` or ``cuda``)."""
    kv_cache: Literal["slots", "paged"] = "slots"
    """Engine KV-cache layout (``EngineConfig.kv_cache``): ``slots`` (a max-length row per request;
    fastest on CPU) or ``paged`` (blocks freed as requests finish, a group's samples share their
    prompt's blocks, Triton decode attention on CUDA). Same tokens either way."""
    cpu_packed_linears: bool = True
    """On CPU in float32/bfloat16, run the engine's linears through oneDNN on weights reordered once
    (``EngineConfig.cpu_packed_linears``): 1.3-3x faster matmuls, one more copy of the weights."""
    placement: Literal["round_robin", "length"] = "round_robin"
    """How a step's prompts are spread over the rollout replicas (multi-process runs):
    ``round_robin`` deals them in order; ``length`` balances their predicted work (each prompt's
    response lengths when last seen; megarl/sched/placement.py). Never changes a sample; it can only
    help once prompts come back (the second epoch over the prompt set)."""

    backend: Literal["megarl", "vllm"] = "megarl"
    """What generates the rollouts: ``megarl`` (megarl's own engine: the exactness reference,
    docs/design.md §1) or ``vllm`` (an in-process ``vllm.LLM``, megarl/engine/vllm_backend.py; the
    optional extra ``make vllm``). The vLLM backend runs on cpu, in float32 or bfloat16, on one or
    several processes, colocated or disaggregated (one vLLM per generating process, rollout TP 1),
    with tail batching, placement, stream training and bubble work, and its samples at T > 0 come
    from vLLM's seeded sampler, not megarl's
    counter-based noise. Speculation there, at T = 0: megarl's draft sources (``spec.enabled``) or
    vLLM's own methods (``vllm_spec``), docs/rollout_backends.md."""
    vllm_spec: VLLMSpecConfig = field(default_factory=VLLMSpecConfig)
    """vLLM's own speculative methods (``ngram``, ``suffix``) on ``backend: vllm``
    (megarl/engine/vllm_spec.py); ``method: none`` by default."""

    dump: bool = False
    """Write every step's samples (prompt uid, sample index, response token ids, reward) to
    ``RUN_DIR/rollouts.jsonl``, one line per step: for inspecting what the policy generates, and
    for checking that two runs sampled the same tokens (``megarl bench schedule``)."""

    def __post_init__(self):
        import re

        from megarl.utils.dataclass_config import check_number

        for name in ("prompts_per_step", "max_new_tokens", "max_batch_size"):
            check_number(f"rollout.{name}", getattr(self, name), ge=1, integer=True)
        check_number("rollout.group_size", self.group_size, ge=2, integer=True,
                     note="GRPO learns from the differences between a prompt's samples: with one sample per prompt "
                          "every advantage is 0 and the policy never changes")
        check_number("rollout.temperature", self.temperature, ge=0, note="0 = greedy")
        check_number("rollout.top_k", self.top_k, ge=0, integer=True, note="0 = off")
        check_number("rollout.top_p", self.top_p, gt=0, le=1, note="1.0 = off")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"rollout.device={self.device!r} is invalid; valid: cpu, cuda or cuda:N (N: a GPU index)")


    def engine_config(self, max_seq_len: int):
        """The rollout engine's ``EngineConfig`` from this section (``max_seq_len``: the model's
        context length)."""
        from megarl.engine import EngineConfig  # (the engine imports nothing of the run config)

        return EngineConfig(max_batch_size=self.max_batch_size, max_seq_len=max_seq_len, dtype=self.dtype,
                            device=self.device, kv_cache=self.kv_cache, cpu_packed_linears=self.cpu_packed_linears)
