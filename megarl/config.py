"""The run config: one nested dataclass tree, loaded from YAML with dotted overrides.

Each component owns its section's dataclass (task, trainer, ...); this module assembles them
and owns the sections that belong to the RL loop itself. ``load_config`` validates the whole
tree before any work starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from megarl.parallel.layout import ParallelConfig
from megarl.parallel.watchdog import WatchdogConfig
from megarl.plan.config import MemoryConfig
from megarl.sched.bubble import ScheduleConfig
from megarl.rl.grpo import GRPOConfig
from megarl.rl.reasoning_gym_data import ReasoningGymConfig
from megarl.rl.rewards import RewardConfig
from megarl.stages.evaluate import EvalConfig
from megarl.rollout.config import RolloutConfig
from megarl.stages.sft import SFTConfig
from megarl.sched.tail import TailConfig
from megarl.rl.task import TaskConfig
from megarl.spec.config import SpecConfig
from megarl.trainer.trainer import TrainerConfig
from megarl.utils.dataclass_config import ConfigError, apply_overrides, check_number, from_dict, to_dict
from megarl.utils.metrics_log import LoggingConfig


@dataclass
class ModelConfig:
    """The policy's architecture, or the HF checkpoint it starts from."""

    init_from_hf: str | None = None
    """Local HF model folder (config.json + safetensors) to start from; the fields below are
    then ignored. None builds a fresh model from them (vocab size from the tokenizer)."""
    init_from_mcore: str | None = None
    """Or a folder written by ``megarl convert hf-to-mcore`` (meta.json + one safetensors file per
    trainer piece) to start from: its tp/pp/vpp/ep must be this run's ``parallel.trainer_*``
    sizes, and each trainer process reads only its own pieces. Or a Megatron-core torch_dist
    folder (``megarl convert hf-to-torch-dist``, a run's ``checkpoints/step_N/trainer``), which
    loads in any colocated layout without virtual stages. Its tokenizer files (copied by the
    converter) serve as ``data.tokenizer_path``'s default."""
    model_type: Literal["qwen2", "llama", "qwen3", "qwen3_moe", "mixtral"] = "qwen2"
    """Architecture family of a fresh model (``qwen3_moe`` and ``mixtral`` are MoE: see the
    ``num_experts`` fields)."""
    hidden_size: int = 64
    """Residual width of a fresh model."""
    intermediate_size: int = 192
    """SwiGLU width of a fresh model."""
    num_hidden_layers: int = 2
    """Decoder layers of a fresh model."""
    num_attention_heads: int = 4
    """Query heads of a fresh model."""
    num_key_value_heads: int = 2
    """KV heads of a fresh model (GQA)."""
    rope_theta: float = 10000.0
    """RoPE base of a fresh model."""
    tie_word_embeddings: bool = True
    """Whether a fresh model's LM head shares the embedding."""
    max_position_embeddings: int = 512
    """Longest prompt + response a fresh model is configured for."""
    num_experts: int = 0
    """Experts per MoE layer of a fresh ``qwen3_moe`` / ``mixtral`` model (0 for dense models)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k) in a fresh MoE model."""
    moe_intermediate_size: int = 0
    """SwiGLU width of each expert of a fresh MoE model (0: ``intermediate_size``)."""
    norm_topk_prob: bool | None = None
    """Renormalise the top-k router probabilities (None: the family's default, as in HF)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads"):
            check_number(f"model.{name}", getattr(self, name), ge=1, integer=True)
        check_number("model.max_position_embeddings", self.max_position_embeddings, ge=2, integer=True,
                     note="the longest prompt + response")
        check_number("model.rope_theta", self.rope_theta, gt=0)
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            check_number(f"model.{name}", getattr(self, name), ge=0, integer=True)
        if self.init_from_hf or self.init_from_mcore:
            return  # the architecture is the checkpoint's: the fields below are not used
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            raise ValueError(f"model.num_key_value_heads={kv} does not divide model.num_attention_heads={heads}; "
                             f"valid: a divisor of {heads}")
        if self.hidden_size % heads or (self.hidden_size // heads) % 2:
            raise ValueError(f"model.hidden_size={self.hidden_size} is invalid with num_attention_heads={heads}: "
                             f"each head needs an even width (RoPE rotates pairs); valid: a multiple of {2 * heads}")
        moe = self.model_type in ("qwen3_moe", "mixtral")
        if moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model.model_type={self.model_type} needs 1 <= model.num_experts_per_tok <= "
                             f"model.num_experts (got num_experts_per_tok={self.num_experts_per_tok}, "
                             f"num_experts={self.num_experts})")
        if not moe and (self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size):
            raise ValueError(f"model.num_experts / num_experts_per_tok / moe_intermediate_size are for MoE models; "
                             f"model.model_type={self.model_type} is dense: set them to 0, or model_type to "
                             f"qwen3_moe or mixtral")


@dataclass
class DataConfig:
    """Where prompts come from, how they are tokenized, how responses are scored."""

    source: Literal["addition", "jsonl", "reasoning_gym", "humaneval"] = "addition"
    """``addition``: the synthetic long-tail task (``task`` section), character tokenizer.
    With a HF tokenizer (``tokenizer_path``): ``jsonl`` (rows with ``prompt`` and ``answer`` from
    ``jsonl_path``), ``reasoning_gym`` (procedural tasks scored by their own verifiers, the
    ``reasoning_gym`` section) or ``humaneval`` (164 Python problems, tests run in the sandbox)."""
    jsonl_path: str | None = None
    """JSONL file of ``{"prompt": ..., "answer": ...}`` rows (source=jsonl)."""
    tokenizer_path: str | None = None
    """Local HF tokenizer folder; defaults to model.init_from_hf (or the init_from_mcore folder)."""
    reward: Literal["exact_answer", "python_tests"] = "exact_answer"
    """Reward of a JSONL set: ``exact_answer`` compares the response's final answer with the
    row's ``answer``; ``python_tests`` runs the response's program followed by the row's
    ``answer`` as test code (``assert`` statements) in a sandbox (the ``reward`` section's limits).
    reasoning_gym and humaneval bring their own verifiers."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Tasks, size, seed and answer convention of source=reasoning_gym."""
    humaneval_limit: int | None = None
    """source=humaneval: use only the first N of the 164 problems (None: all)."""
    chat_template: bool | None = None
    """Apply the tokenizer's chat template to each prompt (a user turn, then the generation
    prompt); None: whenever the tokenizer has one. false feeds prompts as plain text."""
    system_prompt: str | None = None
    """System message put before each prompt with the chat template (None: the template's own
    default, e.g. SmolLM2's "You are a helpful AI assistant named SmolLM ...")."""

    def __post_init__(self) -> None:
        if self.humaneval_limit is not None and self.humaneval_limit < 1:
            raise ValueError(f"data.humaneval_limit={self.humaneval_limit} is invalid; valid: None or >= 1")


@dataclass
class RunConfig:
    """A whole megarl run."""

    seed: int = 1234
    """Run seed: model init, data order and sampling noise all derive from it."""
    rl_steps: int = 30
    """GRPO steps."""
    checkpoint_every: int = 10
    """Write a resumable checkpoint every N RL steps (and after SFT); 0 disables."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk."""
    progress: bool = True
    """Show progress bars."""
    stream_train: bool = False
    """Stream training: train each GRPO group as soon as its last sample finishes, while the rest
    of the step still generates; the optimizer step waits for the step's last group and the loss
    is normalised by the step's final token count, so the update is the same as without it
    (megarl/stream_train/stream.py ``StreamUpdate``). Needs trainer PP = EP = 1 and rollout TP = trainer
    TP: each trainer replica trains the groups its own rollout group generated."""
    deterministic: bool = True
    """Use torch's deterministic algorithms: runs repeat bit for bit and a resumed run reproduces
    the uninterrupted one (on CPU some backward kernels, e.g. embedding gradients, otherwise
    accumulate in a thread-dependent order; measured cost on 2 CPU cores: none)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy architecture or starting checkpoint."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source."""
    task: TaskConfig = field(default_factory=lambda: TaskConfig(max_operand=9, strategy_weights=(1.0, 0.0, 0.0)))
    """Synthetic task settings (data.source=addition); the default is the variant a tiny model
    learns in a minute of CPU SFT (single-digit terms, left-to-right accumulation)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and engine settings."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Megatron trainer settings."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """RL objective."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm-up."""
    tail: TailConfig = field(default_factory=TailConfig)
    """Tail batching (opt-in): short rounds that stop at prompts_per_step complete prompts, long
    rounds over the deferred ones; on-policy."""
    spec: SpecConfig = field(default_factory=SpecConfig)
    """Speculative rollouts (exact: they change speed, never samples)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Failure detection across processes: a process that dies, hangs or raises ends every
    process of the run (non-zero exit, naming the rank and the cause) instead of a hang."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward scoring: worker threads, sandbox limits for code-executing rewards."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Long-tail scheduling: what rollout replicas do in their idle time (bubble work)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts every N steps (off by default; megarl/stages/evaluate.py)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where per-step metrics go besides RUN_DIR/metrics.jsonl: TensorBoard, Weights & Biases."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout: trainer TP/PP/EP (DP is what is left of the world), rollout TP, placement.
    Launch N processes with ``torchrun --nproc_per_node N -m megarl.cli train ...`` (or srun)."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The memory check at start: a run whose memory plan (``megarl plan``) does not fit its
    devices is refused before anything is written (megarl/plan/)."""

    def __post_init__(self):
        check_number("seed", self.seed, ge=0, lt=2 ** 63, integer=True)
        check_number("rl_steps", self.rl_steps, ge=0, integer=True, note="0: SFT and the export only")
        check_number("checkpoint_every", self.checkpoint_every, ge=0, integer=True, note="0: no checkpoints")
        check_number("keep_checkpoints", self.keep_checkpoints, ge=1, integer=True,
                     note="the newest checkpoints kept; a resume needs one")
        # Paths may start with ~ (e.g. the packaged models' cache, ~/.cache/megarl/models/smollm2).
        for section, name in ((self.model, "init_from_hf"), (self.model, "init_from_mcore"),
                              (self.data, "tokenizer_path"), (self.data, "jsonl_path")):
            value = getattr(section, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(section, name, os.path.expanduser(value))
        self.eval.check_against(self.rollout, self.tail.long_rollout_tp, self.parallel.rollout_tp)
        if self.data.source == "jsonl" and not self.data.jsonl_path:
            raise ValueError("data.jsonl_path is required when data.source=jsonl")
        if self.model.init_from_hf and self.model.init_from_mcore:
            raise ValueError("model.init_from_hf and model.init_from_mcore are both set; start from one of them")
        if self.data.source != "addition" and not (self.data.tokenizer_path or self.model.init_from_hf
                                                    or self.model.init_from_mcore):
            raise ValueError(f"data.tokenizer_path (or model.init_from_hf / init_from_mcore) is required when "
                             f"data.source={self.data.source}")
        if self.data.source != "addition" and self.sft.steps > 0:
            raise ValueError(f"sft.steps must be 0 with data.source={self.data.source}: SFT trains on the synthetic "
                             f"task's worked solutions (data.source=addition)")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read ``path`` (YAML; None = defaults), apply ``key.path=value`` overrides, validate."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not a text file (not UTF-8: byte {e.object[e.start]:#04x} at "
                              f"offset {e.start}); expected a YAML mapping of config keys") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            why = " ".join(str(getattr(e, "problem", None) or e).split())
            if isinstance(e, yaml.reader.ReaderError):  # a control character: a binary file
                ch = chr(e.character) if isinstance(e.character, int) else e.character
                where, why = str(path), f"character {ch!r} at offset {e.position}: not a text file"
            raise ConfigError(f"config file {where}: not valid YAML ({why})") from None
        if data is None:
            raise ConfigError(f"config file {path} is empty; give it at least one key (e.g. rl_steps: 30), or leave "
                              f"out --config to use the defaults")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of config keys at top level, got a "
                              f"{type(data).__name__}")
    data = apply_overrides(data, list(overrides), RunConfig)
    return from_dict(RunConfig, data)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
