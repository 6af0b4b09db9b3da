"""Everything a run needs that can fail on bad input, built *before* the run directory is touched.

A misspelt config key, a missing HF file or a malformed dataset row must end the run with one
clear message and leave nothing behind, so all of it is loaded and checked here first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megarl.config import RunConfig
from megarl.engine.tp_model import check_tp
from megarl.models import hub
from megarl.models.config import ModelArgs
from megarl.checkpoint.convert import check_hf_weights
from megarl.checkpoint.safetensors_stream import LazyTensors
from megarl.models.hf_io import read_hf_config, safetensors_files
from megarl.models.mcore_sharding import check_parallel
from megarl.parallel.layout import Layout
from megarl.plan.check import check_memory
from megarl.rl.data import exact_answer_reward, load_jsonl_prompts
from megarl.rl.humaneval import humaneval_reward, load_humaneval
from megarl.rl.reasoning_gym_data import load_reasoning_gym
from megarl.rl.rewards import python_tests_problem_reward
from megarl.rl.task import AdditionTask, Problem
from megarl.rl.tokenizer import CharTokenizer, HFTokenizer
from megarl.stages.evaluate import HeldOut, held_out_set


@dataclass
class RunInputs:
    tokenizer: CharTokenizer | HFTokenizer
    problems: list[Problem]
    """The prompt set, indexed by uid."""
    prompt_ids: list[list[int]]
    """Each problem's prompt as the policy sees it (``tokenizer.encode_prompt``: chat template and
    special tokens applied), indexed by uid; encoded once here, so a bad prompt fails at start."""
    max_seq_len: int
    """The rollout engine's context: the longest prompt plus ``rollout.max_new_tokens`` (never
    more than the model's ``max_position_embeddings``): its KV cache holds no more than that."""
    reward_fn: Callable[[Problem, str], float]
    args: ModelArgs
    init_from_hf: str | None
    """HF folder of the starting weights (checked here; each trainer rank later reads only its
    own piece), or None for a fresh init from the seed."""
    task: AdditionTask | None
    """The synthetic task (for SFT solutions), None for JSONL data."""
    layout: Layout | None = None
    """Where the run's processes go (``parallel`` section checked against WORLD_SIZE and the model)."""
    init_from_mcore: str | None = None
    """Or a converted Megatron folder of the starting weights (``megarl convert hf-to-mcore``, in
    this run's trainer layout)."""
    data_sha256: str = ""
    """:func:`data_digest` of the prompt set: recorded in every checkpoint, checked on resume."""
    held_out: HeldOut | None = None
    """The ``eval`` section's held-out prompts (megarl/stages/evaluate.py), None without them."""

    @property
    def train_size(self) -> int:
        """How many prompts training draws from (uids ``0 .. train_size-1``)."""
        return self.held_out.train_size if self.held_out is not None else len(self.problems)


def data_digest(problems: list[Problem], prompt_ids: list[list[int]]) -> str:
    """SHA-256 of what a run trains on: every problem's uid, prompt and answer, and the prompt
    token ids the policy sees. A resume compares it with the checkpoint's: a dataset file edited
    between the start and the resume (every answer changed) trains on other data."""
    h = hashlib.sha256()
    for p, ids in zip(problems, prompt_ids, strict=True):
        h.update(json.dumps([p.uid, p.prompt, p.answer, ids], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def check_layout(cfg: RunConfig, args: ModelArgs, world_size: int | None = None) -> Layout:
    """The run's process layout, or a ValueError naming the field that does not fit. The world
    size is torchrun's/srun's ``WORLD_SIZE`` (1 when launched directly)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    p = cfg.parallel
    layout = Layout.build(p, world, args.num_attention_heads, args.num_key_value_heads, args.num_hidden_layers,
                          getattr(args, "num_experts", 0) or 0)
    if cfg.trainer.checkpoint_format == "torch_dist" and (p.placement == "disaggregated" or p.trainer_vpp > 1):
        raise ValueError(f"trainer.checkpoint_format=torch_dist needs parallel.placement=colocated and "
                         f"parallel.trainer_vpp=1 (Megatron's distributed save is collective over every process; "
                         f"virtual pipeline stages are untried); this run has placement={p.placement}, "
                         f"trainer_vpp={p.trainer_vpp}: use trainer.checkpoint_format=pieces")
    if p.placement == "disaggregated" and cfg.stream_train:
        raise ValueError("stream_train=true needs parallel.placement=colocated: with disaggregated placement the "
                         "trainers get a step's groups once its rollout is over (streaming them over while the "
                         "rollout runs is not built); or use stream_train=false")
    check_parallel(args, p.trainer_tp, p.trainer_pp, p.trainer_ep, vpp=p.trainer_vpp)
    if p.rollout_tp > 1:
        check_tp(args, p.rollout_tp)
    if cfg.stream_train and (p.trainer_pp, p.trainer_ep, p.rollout_tp) != (1, 1, p.trainer_tp):
        raise ValueError(f"stream_train=true needs parallel.trainer_pp = trainer_ep = 1 and rollout_tp = trainer_tp "
                         f"(got trainer_pp={p.trainer_pp}, trainer_ep={p.trainer_ep}, rollout_tp={p.rollout_tp}, "
                         f"trainer_tp={p.trainer_tp}): each trainer replica trains the groups its own rollout group "
                         f"generated, as soon as they finish, so a trainer's TP group must be a rollout group (and "
                         f"pipeline stages or expert all-to-alls would need other replicas' groups mid-rollout); "
                         f"or use stream_train=false")
    long_tp = cfg.tail.long_rollout_tp
    if long_tp not in (0, p.rollout_tp):  # elastic rollout TP
        why = ("tail.enabled=false" if not cfg.tail.enabled else "placement=disaggregated" if p.placement != "colocated"
               else "stream_train=true" if cfg.stream_train
               else "spec.drafter.enabled=true" if cfg.spec.enabled and cfg.spec.drafter.enabled else None)
        if why is not None:
            raise ValueError(f"tail.long_rollout_tp={long_tp} (elastic rollout TP for tail batching's long rounds) "
                             f"does not go with {why}; valid: tail.long_rollout_tp=0, or tail batching on, "
                             f"colocated, without stream training or the learned drafter")
        long_layout = Layout.build(dataclasses.replace(p, rollout_tp=long_tp), world, args.num_attention_heads,
                                   args.num_key_value_heads, args.num_hidden_layers,
                                   getattr(args, "num_experts", 0) or 0)
        if long_tp > 1:
            check_tp(args, long_tp)
        if cfg.rollout.prompts_per_step < long_layout.rollout_dp:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} leaves some of the "
                             f"{long_layout.rollout_dp} long-round rollout groups (tail.long_rollout_tp={long_tp}) "
                             f"without a prompt; valid: >= {long_layout.rollout_dp}")
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if seqs < layout.trainer_dp:
        raise ValueError(f"rollout.prompts_per_step * group_size = {seqs} sequences per step cannot give each of "
                         f"the {layout.trainer_dp} trainer data-parallel ranks a row; valid: >= {layout.trainer_dp}")
    if cfg.sft.steps > 0 and cfg.sft.batch_size < layout.trainer_dp:
        raise ValueError(f"sft.batch_size={cfg.sft.batch_size} is smaller than the trainer's data-parallel size "
                         f"{layout.trainer_dp}; valid: >= {layout.trainer_dp}")
    if cfg.rollout.prompts_per_step < layout.rollout_dp:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} leaves some of the "
                         f"{layout.rollout_dp} rollout groups without a prompt; valid: >= {layout.rollout_dp}")
    _check_backend(cfg, args)
    return layout


def _check_backend(cfg: RunConfig, args: ModelArgs) -> None:
    """The rollout backend's own settings: vLLM's what it runs, and its speculation only on it."""
    if cfg.rollout.backend == "vllm":
        check_vllm_backend(cfg, args)
    elif cfg.rollout.vllm_spec.method != "none":
        raise ValueError(f"rollout.vllm_spec.method={cfg.rollout.vllm_spec.method} is vLLM's speculation, but "
                         f"rollout.backend={cfg.rollout.backend}; valid: rollout.backend=vllm, or spec.enabled=true "
                         f"for megarl's engine")


def check_vllm_backend(cfg: RunConfig, args: ModelArgs) -> None:
    """What the vLLM rollout backend (megarl/engine/vllm_backend.py) runs today, checked at start:
    anything else is refused with one line rather than half done. Several processes, colocated or
    disaggregated, run rollout TP 1, each generating process its own in-process vLLM (rollout DP =
    the generating processes; trainer-only processes join vLLM's process groups without one:
    megarl/engine/vllm_groups.py); its CPU build runs TP > 1 only in worker processes of its own."""
    from megarl.engine.vllm_backend import INSTALL_HINT, vllm_missing

    r, p = cfg.rollout, cfg.parallel
    refused = [(p.rollout_tp > 1, f"parallel.rollout_tp={p.rollout_tp}",
                "parallel.rollout_tp=1 (the in-process vllm-cpu engine runs TP 1; rollout DP = the generating "
                "processes)"),
               (cfg.tail.enabled and cfg.tail.long_rollout_tp > 1, f"tail.long_rollout_tp={cfg.tail.long_rollout_tp}",
                "tail.long_rollout_tp=0 or 1 (the in-process vllm-cpu engine runs TP 1)"),
               (r.device != "cpu", f"rollout.device={r.device}", "rollout.device=cpu (the vllm-cpu build)"),
               (r.dtype == "float64", "rollout.dtype=float64", "float32 or bfloat16"),
               (cfg.spec.enabled and cfg.spec.drafter.enabled, "spec.drafter.enabled=true",
                "spec.drafter.enabled=false (megarl's draft sources propose through vLLM; its drafter does not)"),
               (cfg.spec.enabled and cfg.spec.bubble_pregen, "spec.bubble_pregen=true",
                "spec.bubble_pregen=false (vLLM does not pre-generate bubble drafts yet)"),
               ((cfg.spec.enabled or r.vllm_spec.method != "none")
                and max(r.temperature, cfg.eval.temperature or 0.0) > 0,
                f"speculation at temperature {max(r.temperature, cfg.eval.temperature or 0.0)} (rollout or eval)",
                "rollout.temperature=0 and eval.temperature=0, or no drafts: vLLM-CPU's rejection sampler does not "
                "keep the target distribution (docs/rollout_backends.md)"),
               (cfg.spec.enabled and r.vllm_spec.method != "none",
                f"spec.enabled=true together with rollout.vllm_spec.method={r.vllm_spec.method}",
                "one of the two (megarl's draft sources, or vLLM's own method)"),
               ((cfg.spec.enabled or r.vllm_spec.method != "none") and cfg.tail.enabled,
                "drafts together with tail.enabled=true", "no drafts with tail batching on vLLM (not tested together)"),
               (bool(getattr(args, "num_experts", 0)), "a mixture-of-experts model", "a dense Llama/Qwen2/Qwen3 model"),
               (r.temperature not in (0.0, 1.0) and (r.top_k > 0 or r.top_p < 1.0),
                f"rollout.temperature={r.temperature} with top_k/top_p on",
                "temperature 0 or 1 with top-k/top-p, or top_k=0 and top_p=1.0 (vLLM's logprobs at other "
                "temperatures are those of the filtered distribution, not docs/design.md §1.3's)")]
    for bad, what, valid in refused:
        if bad:
            raise ValueError(f"rollout.backend=vllm does not support {what} yet; valid: {valid}, or "
                             f"rollout.backend=megarl")
    missing = vllm_missing()
    if missing is not None:
        raise ValueError(f"rollout.backend=vllm but vLLM cannot be imported here ({missing}); {INSTALL_HINT}")
    if r.vllm_spec.method == "suffix":
        from megarl.engine.vllm_spec import suffix_missing

        if (why := suffix_missing()) is not None:
            raise ValueError(f"rollout.vllm_spec.method=suffix: {why}")


def _data(cfg: RunConfig):
    """Tokenizer, problems, reward and (synthetic task only) the task, from the ``data`` section."""
    d = cfg.data
    if d.source == "addition":
        task = AdditionTask(cfg.task)
        return CharTokenizer(), [task.problem(uid) for uid in range(len(task))], task.reward, task
    tok_dir = d.tokenizer_path or cfg.model.init_from_hf or cfg.model.init_from_mcore
    # Stop tokens come from the model's generation_config.json (beside the weights).
    tokenizer = HFTokenizer(tok_dir, chat_template=d.chat_template, system_prompt=d.system_prompt,
                            generation_config=cfg.model.init_from_hf or cfg.model.init_from_mcore or tok_dir)
    if d.source == "jsonl":
        problems = load_jsonl_prompts(d.jsonl_path, tokenizer)
        reward_fn = exact_answer_reward if d.reward == "exact_answer" else python_tests_problem_reward
    elif d.source == "reasoning_gym":
        problems, reward_fn = load_reasoning_gym(d.reasoning_gym)
    else:
        problems, reward_fn = load_humaneval(d.humaneval_limit), humaneval_reward
    return tokenizer, problems, reward_fn, None


def _cannot_encode(exc: BaseException) -> bool:
    """What a tokenizer raises for text it cannot encode: ``ValueError`` (CharTokenizer), the plain
    ``Exception`` of HF ``tokenizers`` (e.g. a character without an id and no unknown token), a
    chat template's ``TemplateError``."""
    return isinstance(exc, ValueError) or type(exc) is Exception or type(exc).__name__.endswith("TemplateError")


def encode_prompts(problems: list[Problem], tokenizer, max_new_tokens: int, max_len: int,
                   where: Callable[[Problem], str] | None = None,
                   max_len_key: str = "model.max_position_embeddings") -> list[list[int]]:
    """Every prompt's ids, each checked to encode, to be non-empty and to leave room for
    ``max_new_tokens`` in the model's context. ``where``: how a message names a prompt (default
    ``prompt uid N``; a JSONL set's ``FILE:LINE``); ``max_len_key``: where ``max_len`` comes from
    (the config key of a fresh model, a checkpoint's config file)."""
    where = where or (lambda p: f"prompt uid {p.uid}")
    ids = []
    for p in problems:
        try:
            row = tokenizer.encode_prompt(p.prompt)
        except Exception as e:  # noqa: BLE001 - only a tokenizer's "cannot encode" is a user error
            if not _cannot_encode(e):
                raise
            raise ValueError(f"{where(p)}: the tokenizer cannot encode the prompt ({' '.join(str(e).split())})") \
                from None
        if not row:
            raise ValueError(f"{where(p)}: the prompt is empty (0 tokens); every prompt needs text for the policy "
                             f"to answer")
        ids.append(row)
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    n = len(ids[longest])
    if n + max_new_tokens > max_len:
        fix = (f"rollout.max_new_tokens <= {max_len - n}, " if n < max_len else "") + \
              f"or a model with max_position_embeddings >= {n + max_new_tokens}"
        raise ValueError(f"{where(problems[longest])}: the prompt is {n} tokens; with rollout.max_new_tokens="
                         f"{max_new_tokens} it needs {n + max_new_tokens} positions but {max_len_key}={max_len}; "
                         f"valid: a shorter prompt, {fix}")
    return ids


def _hf_model_args(folder: str) -> ModelArgs:
    """The architecture of the HF folder ``model.init_from_hf``; a ValueError naming its
    ``config.json`` if that is not a readable HF config."""
    cfg_path = Path(folder) / "config.json"
    try:
        hf_cfg = read_hf_config(folder)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({' '.join(str(e).split())}); expected the model's HF config "
                         f"(config.json as transformers saves it)") from None
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object (the model's HF config), got a {type(hf_cfg).__name__}")
    try:
        return ModelArgs.from_hf_config(hf_cfg)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"{cfg_path}: not a usable HF model config ({type(e).__name__}: {e})") from e


def check_device(device: str, key: str = "rollout.device") -> None:
    """A ``cuda`` device that this machine has (the name itself is checked by the config)."""
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{key}={device} but no CUDA device is available here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'none'}); valid here: cpu")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise ValueError(f"{key}={device} but this machine has {torch.cuda.device_count()} CUDA device(s); valid: "
                         f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    cfg.logging.check_packages()  # TensorBoard / W&B asked for but not installed
    # Hub ids (where a hub is reachable) become their downloaded folders; local paths stay.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, init_from_hf=hub.resolve(cfg.model.init_from_hf, "model.init_from_hf")), data=dataclasses.replace(
        cfg.data, tokenizer_path=hub.resolve(cfg.data.tokenizer_path, "data.tokenizer_path")))
    check_device(cfg.rollout.device)
    # The model folder's config.json before its tokenizer (which may read it too): a broken one is named.
    hf_args = _hf_model_args(cfg.model.init_from_hf) if cfg.model.init_from_hf else None
    tokenizer, problems, reward_fn, task = _data(cfg)
    check_containment(cfg, reward_fn)

    if cfg.model.init_from_hf:
        args = hf_args
        # Names, shapes and dtypes from the file headers: bad weights fail here, before anything is
        # written; the tensors themselves are read per rank by the trainer.
        with LazyTensors(safetensors_files(cfg.model.init_from_hf)) as src:
            check_hf_weights(src, args)
        if args.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model.init_from_hf vocab_size={args.vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size}")
    elif cfg.model.init_from_mcore:
        args = _check_mcore_start(cfg, tokenizer.vocab_size)
    else:
        m = cfg.model
        args = ModelArgs(
            vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, rope_theta=m.rope_theta,
            tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=m.max_position_embeddings,
            model_type=m.model_type, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
            **({"num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
                "moe_intermediate_size": m.moe_intermediate_size or m.intermediate_size,
                "norm_topk_prob": m.norm_topk_prob} if m.num_experts else {}),
        )
    if args.eos_token_id is None:
        args.eos_token_id = tokenizer.eos_id
    where = (lambda p: f"{cfg.data.jsonl_path}:{p.uid + 1}") if cfg.data.source == "jsonl" else None
    start = cfg.model.init_from_hf or cfg.model.init_from_mcore
    limit_key = f"max_position_embeddings of {start}" if start else "model.max_position_embeddings"
    prompt_ids = encode_prompts(problems, tokenizer, cfg.rollout.max_new_tokens, args.max_position_embeddings, where,
                                limit_key)
    _check_drafter_start(cfg, args)
    max_seq_len = max(map(len, prompt_ids)) + cfg.rollout.max_new_tokens
    held_out = held_out_set(cfg.eval, problems, prompt_ids, tokenizer, task, max_seq_len,
                            cfg.rollout.prompts_per_step)
    layout = check_layout(cfg, args)
    check_memory(cfg, args, layout.world_size, max_seq_len)  # a run that cannot fit its devices ends here
    return RunInputs(tokenizer=tokenizer, problems=problems, prompt_ids=prompt_ids, max_seq_len=max_seq_len,
                     reward_fn=reward_fn, args=args,
                     init_from_hf=cfg.model.init_from_hf, init_from_mcore=cfg.model.init_from_mcore, task=task,
                     layout=layout, data_sha256=data_digest(problems, prompt_ids), held_out=held_out)


def check_containment(cfg: RunConfig, reward_fn) -> None:
    """A reward that runs model-written code needs a sandbox that contains it (bubblewrap), or the
    user's explicit ``reward.allow_uncontained=true``."""
    from megarl.rl.reward_pool import is_sandboxed
    from megarl.rl.sandbox import containment_problem

    if not is_sandboxed(reward_fn) or cfg.reward.allow_uncontained:
        return
    problem = containment_problem()
    if problem is not None:
        what = "data.source=humaneval" if cfg.data.source == "humaneval" else f"data.reward={cfg.data.reward}"
        raise ValueError(f"{what} runs model-written code, and the sandbox cannot contain it on this machine "
                         f"({problem}): install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; it needs "
                         f"unprivileged user namespaces), or set reward.allow_uncontained=true to run it with "
                         f"time, memory and file-size limits and network isolation only")


def _check_drafter_start(cfg: RunConfig, args: ModelArgs) -> None:
    """``spec.drafter.init_from``: a drafter folder made for this policy (loaded once here)."""
    d = cfg.spec.drafter
    if cfg.spec.enabled and d.enabled and d.init_from:
        from megarl.spec.drafter import load_drafter

        try:
            load_drafter(d.init_from, args)
        except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"spec.drafter.init_from={d.init_from}: {e}") from e


def _check_torch_dist_start(cfg: RunConfig, tokenizer_vocab: int) -> ModelArgs:
    """The model of a ``model.init_from_mcore`` torch_dist folder (``megarl convert hf-to-torch-dist``
    or a run's trainer checkpoint): its recorded HF config, in a layout that loads it."""
    from megarl.trainer.dist_convert import checkpoint_hf_config

    path, p = cfg.model.init_from_mcore, cfg.parallel
    if p.placement == "disaggregated" or p.trainer_vpp > 1:
        raise ValueError(f"model.init_from_mcore={path} is a torch_dist folder, whose load is collective over every "
                         f"process: it needs parallel.placement=colocated and parallel.trainer_vpp=1 (this run has "
                         f"placement={p.placement}, trainer_vpp={p.trainer_vpp}); or start from its HF folder "
                         f"(`megarl convert torch-dist-to-hf`) with model.init_from_hf")
    args = ModelArgs.from_hf_config(checkpoint_hf_config(path))
    if args.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.init_from_mcore vocab_size={args.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer_vocab}")
    return args


def _check_mcore_start(cfg: RunConfig, tokenizer_vocab: int) -> ModelArgs:
    """The model of ``model.init_from_mcore``, after checking (meta.json and every piece's header
    on the converter's checks) that it is a complete checkpoint in this run's trainer layout."""
    from megarl.checkpoint.convert import read_meta

    from megarl.trainer.dist_convert import is_torch_dist

    path, p = cfg.model.init_from_mcore, cfg.parallel
    if is_torch_dist(path):  # any layout: Megatron reshards on load (megarl/trainer/dist_convert.py)
        return _check_torch_dist_start(cfg, tokenizer_vocab)
    meta, args = read_meta(path)  # corrupted meta, missing pieces: a clear error here
    want = {"tp": p.trainer_tp, "pp": p.trainer_pp, "vpp": p.trainer_vpp, "ep": p.trainer_ep}
    got = {k: meta[k] for k in want}
    if got != want:
        raise ValueError(f"model.init_from_mcore={path} was converted with {got}, this run's trainer has {want} "
                         f"(parallel.trainer_tp/pp/vpp/ep): convert it again with `megarl convert hf-to-mcore "
                         f"--tp {want['tp']} --pp {want['pp']} --vpp {want['vpp']} --ep {want['ep']}` (from HF: "
                         f"`megarl convert mcore-to-hf` gives it back), or use model.init_from_hf")
    if args.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.init_from_mcore vocab_size={args.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer_vocab}")
    return args
