"""What starting the vLLM rollout backend's ``vllm.LLM`` takes: its arguments, and vLLM's process
groups on every process of the run, those that start no vLLM included (docs/rollout_backends.md,
"Several processes").

Why the processes that start no vLLM take part. Once torch.distributed is initialised (by the
run), a ``vllm.LLM`` builds vLLM's world and model-parallel groups over the run's default
process group, and ``torch.distributed.new_group`` is collective over that group: every process
must call it for every group, in the same order, since torch names a group by the number of
groups the process has made before (a member that counts differently waits for peers under
another name, for ever). With disaggregated placement the trainer-only processes therefore make
the same calls, at the point where the generating processes start their ``LLM``
(:class:`VLLMGroups`, called from megarl/train.py where a generating process builds its engine).

The calls, as read in vLLM 0.32's source (vllm/distributed/parallel_state.py,
vllm/v1/worker/cpu_worker.py, gpu_worker.py, vllm/v1/executor/uniproc_executor.py): the in-process
``UniProcExecutor`` has its ``CPUWorker.init_device`` call ``init_worker_distributed_environment
(vllm_config, rank 0, a file:// init method, local rank 0, "gloo")``, under the ``LLM``'s
``VllmConfig``, which calls

1. ``init_distributed_environment``: torch.distributed is initialised, so only the world
   ``GroupCoordinator`` over every rank (two ``new_group``: a device group and a gloo group), then
   ``_node_count`` over its gloo group (``in_the_same_node_as``: a broadcast, a barrier and an
   all-reduce);
2. ``ensure_model_parallel_initialized(tp, pp, pcp, dcp)`` -> ``initialize_model_parallel``: the
   TP, DCP, PCP, PP and DP coordinators over groups of one rank each at TP 1 (two ``new_group``
   per rank, each), and the Engram, EP and EPLB groups only for models that have them (they
   depend on the config's model: dense here, so none);
3. ``ensure_ec_transfer_initialized``: nothing without an encoder-cache transfer config.

Nothing else in the ``LLM``'s start makes a group or calls a collective on these groups (one
in-process engine core, no vLLM data parallelism). A trainer-only process calls that same
function with the ``VllmConfig`` that the ``LLM`` builds from the same arguments
(``EngineArgs(...).create_engine_config``, :func:`llm_arguments`): the sequence is the same by
construction, not by a copy of it. Before either, every process checks that all have made the
same number of groups so far (:func:`check_group_count`), so a mismatch is named, not a hang.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch

from megarl.engine.requests import EngineConfig
from megarl.models.config import ModelArgs


def _vllm_env() -> None:
    """vLLM's settings this backend needs, set before vLLM is imported. The engine core runs in
    this process (the weights are loaded into its model in place); OpenMP threads are not pinned by
    default: on a shared machine pinned threads wait on busy cores (set
    VLLM_CPU_OMP_THREADS_BIND=auto on a dedicated one)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def logprobs_mode(temperature: float) -> str:
    """vLLM's logprob convention that equals docs/design.md §1.3's at ``temperature``."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


def _forget_stale_vllm_groups() -> None:
    """vLLM keeps its world and model-parallel groups in module globals, made once per process over
    the default process group. If that group was destroyed since (an earlier vLLM's shutdown, or a
    run or test that set up torch.distributed again), a new ``LLM`` would reuse the stale groups and
    fail ("not initialized in the world group map"): forget them, so it makes its own anew. Torch
    has already dropped them; nothing is destroyed here."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    world = ps._WORLD
    if world is None:
        return
    if dist.is_initialized() and getattr(world, "device_group", None) in dist.distributed_c10d._world.pg_map:
        return  # still valid: this process's vLLM groups are live
    for name, value in list(vars(ps).items()):
        if isinstance(value, ps.GroupCoordinator):
            setattr(ps, name, None)
    ps._NODE_COUNT = None


def check_group_count() -> None:
    """Every process of the run has made the same number of process groups so far (collective over
    the default group; nothing to check without one, or alone). vLLM's groups are about to be made
    on every process, and torch names each by that count (module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, dist.distributed_c10d._world.group_count)
    if len(set(counts)) > 1:
        raise RuntimeError(f"vLLM's process groups cannot be built: the processes have made different numbers of "
                           f"process groups so far ({counts}, by rank); each new_group call must be made by every "
                           f"process in the same order (megarl/engine/vllm_groups.py)")


@contextlib.contextmanager
def llm_arguments(args: ModelArgs, cfg: EngineConfig, seed: int, temperature: float, spec_config: dict | None):
    """The keyword arguments of the backend's ``vllm.LLM``, valid inside the block: the model's HF
    config in a temporary folder (placeholder weights: the first sync replaces them before any
    rollout), its KV cache sized for max_batch_size requests of max_seq_len positions (rounded up
    to 256, a multiple of any block size vLLM-CPU uses), in bytes: not vLLM-CPU's whole GiB
    (``VLLM_CPU_KVCACHE_SPACE``, which would override it), a GiB per process that several
    processes on a shared machine may not find free. The caller's RNG states are kept (vLLM
    reseeds the process); vLLM's stale groups are forgotten."""
    _vllm_env()
    positions = -(-cfg.max_seq_len // 256) * 256 * cfg.max_batch_size
    kv_bytes = (2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * positions
                * torch.empty((), dtype=cfg.torch_dtype).element_size())
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    folder = tempfile.mkdtemp(prefix="megarl-vllm-")
    states = random.getstate(), np.random.get_state()
    try:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(args.to_hf_config(cfg.dtype), f)
        _forget_stale_vllm_groups()
        with torch.random.fork_rng():
            yield dict(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype=cfg.dtype,
                       max_model_len=cfg.max_seq_len, max_num_seqs=cfg.max_batch_size, seed=seed,
                       enforce_eager=True, logprobs_mode=logprobs_mode(temperature), disable_log_stats=True,
                       kv_cache_memory_bytes=kv_bytes, speculative_config=spec_config)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        shutil.rmtree(folder, ignore_errors=True)


class VLLMGroups:
    """vLLM's process groups on a process that starts no vLLM (disaggregated placement: a trainer),
    made with the arguments of the generating processes' ``LLM`` (module docstring); built where
    those start theirs. :meth:`close` tears them down as a generating process's engine core does
    at its shutdown (the default process group included)."""

    def __init__(self, args: ModelArgs, cfg: EngineConfig, seed: int, temperature: float, spec_config: dict | None):
        with llm_arguments(args, cfg, seed, temperature, spec_config) as kwargs:
            from vllm.config import set_current_vllm_config
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

            vllm_config = EngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)  # as LLM's
            check_group_count()
            with set_current_vllm_config(vllm_config):  # as WorkerWrapperBase.init_device
                # the UniProcExecutor's worker arguments: rank 0, local rank 0 (device "cpu"); the init
                # method is not read once torch.distributed is initialised
                init_worker_distributed_environment(vllm_config, 0, None, 0, current_platform.dist_backend)

    def close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
