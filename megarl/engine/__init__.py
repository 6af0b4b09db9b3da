"""Native rollout engine: counter-based sampler, slot KV cache, continuous-batching engine."""
from megarl.engine.engine import Engine
from megarl.engine.requests import EngineConfig, Request, Result
from megarl.engine.kv_cache import CacheAttention, KVCache, SlotTable
from megarl.engine.sampler import SampleOutput, SamplingParams, filter_logits, gumbel_noise, noise_hash, sample

__all__ = [
    "CacheAttention", "Engine", "EngineConfig", "KVCache", "Request", "Result", "SampleOutput",
    "SamplingParams", "SlotTable", "filter_logits", "gumbel_noise", "noise_hash", "sample",
]
