"""Model architecture description shared by the engine, the trainer and the converter.

It is read from (and written to) a Hugging Face ``config.json``, so that the HF config is the
single source of truth for shapes wherever a model is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megarl.models.rope import check_rope_scaling

# HF ``architectures`` entries of the decoder family that megarl's plain-torch model covers.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# Model types whose attention RMS-normalises each query and key head before RoPE (q_norm/k_norm).
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# Model types whose every decoder layer has a sparse MoE block instead of the dense MLP.
MOE_TYPES = ("qwen3_moe", "mixtral")


@dataclass
class ModelArgs:
    """Shapes and options of a Llama/Qwen2/Qwen3-family decoder, dense or MoE (HF ``config.json``
    field names; Mixtral's ``num_local_experts`` is read into ``num_experts``)."""

    vocab_size: int
    """Number of rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """Width of the SwiGLU MLP's gate/up projections (unused by Qwen3-MoE, whose layers are all
    sparse; Mixtral's experts have this width)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Number of query heads."""
    num_key_value_heads: int
    """Number of key/value heads (GQA); must divide ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width; defaults to ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """None: plain RoPE. Else HF's ``rope_parameters`` without ``rope_theta``: ``rope_type`` 'llama3'
    (factor, low/high_freq_factor, original_max_position_embeddings) or 'yarn' (factor,
    original_max_position_embeddings, optional attention_factor, beta_fast/slow, mscale(_all_dim),
    truncate); the formulas are in megarl/models/rope.py."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is configured for."""
    sliding_window: int | None = None
    """None: full causal attention. Else the window of the sliding-attention layers: a query at
    position i sees the keys at positions i - sliding_window < j <= i (HF Qwen2/Qwen3/Mixtral)."""
    layer_types: list[str] | None = None
    """With ``sliding_window``: each layer's ``full_attention`` or ``sliding_attention`` (HF's
    ``layer_types``); None = every layer sliding. None without a window."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Whether q/k/v projections carry a bias (Qwen2 always does)."""
    model_type: str = "qwen2"
    """``llama``, ``qwen2``, ``qwen3`` (q/k norm), ``qwen3_moe`` (q/k norm, MoE) or ``mixtral`` (MoE)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the tokenizer has one."""
    eos_token_id: int | None = None
    """End-of-sequence token id: generation stops when it is sampled."""
    pad_token_id: int | None = None
    """Padding token id (never sampled by megarl; kept for HF round trips)."""
    num_experts: int = 0
    """Routed experts per MoE layer (HF Mixtral: ``num_local_experts``); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k of the router's softmax); 0 for a dense model."""
    moe_intermediate_size: int = 0
    """Width of each expert's gate/up projections; 0 for a dense model (Mixtral: its
    ``intermediate_size``, filled in when 0)."""
    norm_topk_prob: bool | None = None
    """Whether the top-k routing weights are renormalised to sum to 1. None: the model type's
    default (HF's Qwen3-MoE default False; Mixtral always renormalises: True)."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.norm_topk_prob is None:
            self.norm_topk_prob = self.model_type == "mixtral"
        if self.model_type == "mixtral" and not self.moe_intermediate_size:
            self.moe_intermediate_size = self.intermediate_size
        if self.model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; valid choices: "
                f"{sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
            )
        check_rope_scaling(self.rope_scaling)
        self._check_window()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.model_type in MOE_TYPES:
            self._check_moe()
        elif self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
            raise ValueError(
                f"model_type={self.model_type!r} is dense but num_experts={self.num_experts}, "
                f"num_experts_per_tok={self.num_experts_per_tok}, moe_intermediate_size="
                f"{self.moe_intermediate_size} are set; MoE model types: {list(MOE_TYPES)}"
            )
        if self.model_type in ("qwen3", "qwen3_moe", "mixtral") and self.attention_bias:
            # Qwen3's attention_bias would also put a bias on o_proj, which the Megatron mapping
            # has no place for; released Qwen3/Mixtral checkpoints have no attention biases.
            raise ValueError(f"attention_bias=True is not supported for model_type={self.model_type!r}")

    def _check_window(self) -> None:
        if self.sliding_window is None:
            if self.layer_types is not None and "sliding_attention" in self.layer_types:
                raise ValueError(f"layer_types={self.layer_types} has sliding layers but sliding_window=None")
            self.layer_types = None
            return
        if self.model_type == "llama":
            raise ValueError(f"sliding_window={self.sliding_window} is not part of HF Llama; sliding-window "
                             f"model types: qwen2, qwen3, qwen3_moe, mixtral")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be an integer >= 1 (or None)")
        if self.layer_types is None:
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        kinds = {"full_attention", "sliding_attention"}
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= kinds:
            raise ValueError(f"layer_types={self.layer_types} must name {self.num_hidden_layers} layers, each one "
                             f"of {sorted(kinds)}")
        if self.model_type in MOE_TYPES and "full_attention" in self.layer_types:
            raise ValueError(f"model_type={self.model_type!r} slides the window over every layer; got "
                             f"layer_types={self.layer_types}")

    def window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx``; None: full causal attention."""
        if self.sliding_window is None or self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> list[int | None] | None:
        """Each layer's window (:meth:`window`), or None for a model without sliding windows."""
        return None if self.sliding_window is None else [self.window(i) for i in range(self.num_hidden_layers)]

    def _check_moe(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts} must be >= 1 for model_type={self.model_type!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1 for "
                             f"model_type={self.model_type!r}")
        if self.model_type == "mixtral":
            if not self.norm_topk_prob:
                raise ValueError("norm_topk_prob=False is not Mixtral's routing (it always renormalises "
                                 "the top-k weights); use model_type='qwen3_moe' for unnormalised routing")
            if self.moe_intermediate_size != self.intermediate_size:
                raise ValueError(f"Mixtral experts have width intermediate_size={self.intermediate_size}; "
                                 f"got moe_intermediate_size={self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        """Every decoder layer has a sparse MoE block (megarl has no mixed dense/sparse stacks)."""
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Whether attention RMS-normalises each query/key head (``q_norm``/``k_norm``) before RoPE."""
        return self.model_type in QK_NORM_TYPES

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        """HF Llama's ``attention_bias`` also puts a bias on o_proj; Qwen2 never has one."""
        return self.attention_bias and self.model_type == "llama"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a parsed HF ``config.json``; unsupported architectures fail loudly."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs:
            known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
            if not known:
                raise ValueError(
                    f"unsupported architecture {archs}; valid choices: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
            model_type = known[0]
        if model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"unsupported model_type {model_type!r}; valid choices: "
                f"{sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
            )
        cfg = dict(cfg)
        cfg.update(_rope_fields_from_hf(cfg))
        cfg.update(_window_fields_from_hf(cfg, model_type))
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        if model_type in MOE_TYPES:
            cfg = _moe_fields_from_hf(cfg, model_type)
        names = {f.name for f in dataclasses.fields(cls)} - {"model_type", "eos_token_id"}
        kwargs = {k: cfg[k] for k in names if k in cfg and cfg[k] is not None}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in kwargs]
        if missing:
            raise ValueError(f"HF config is missing required fields {missing}")
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        return cls(model_type=model_type, eos_token_id=eos, **kwargs)

    def to_hf_config(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The HF ``config.json`` that ``transformers`` loads into the matching class."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        cfg.update(
            architectures=[arch],
            hidden_act="silu",
            torch_dtype=torch_dtype,
            use_cache=True,
            attention_dropout=0.0,
        )
        if self.rope_scaling is None:
            cfg.pop("rope_scaling")
        else:  # transformers 5 reads scaled RoPE from rope_parameters (rope_theta included)
            cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": self.rope_theta}
        if not self.is_moe:
            for name in _MOE_FIELDS:  # dense configs carry no MoE fields
                cfg.pop(name)
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            cfg["use_sliding_window"] = self.sliding_window is not None
            if self.model_type == "qwen3_moe" or self.layer_types is None:
                cfg.pop("layer_types")  # Qwen3-MoE has none (its window covers every layer)
        if self.model_type == "qwen2":
            cfg.pop("attention_bias")  # Qwen2 always has qkv bias; HF's config has no such field
        elif self.model_type in ("qwen3", "qwen3_moe"):
            if self.model_type == "qwen3_moe":
                # Every layer sparse: the only layout megarl's models (and their mapping) cover.
                cfg.update(decoder_sparse_step=1, mlp_only_layers=[])
        elif self.model_type == "mixtral":
            cfg.pop("attention_bias")  # Mixtral's config has no such field (and never a bias)
            cfg.pop("norm_topk_prob")  # always renormalised
            cfg["num_local_experts"] = cfg.pop("num_experts")
            cfg.pop("moe_intermediate_size")  # = intermediate_size
            cfg.pop("layer_types")  # Mixtral's window covers every layer
            cfg["router_jitter_noise"] = 0.0
        else:
            cfg["mlp_bias"] = False
            cfg.pop("sliding_window")
            cfg.pop("layer_types")
        return cfg


def _rope_fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` (ModelArgs names) of an HF config: transformers >= 5 writes
    RoPE settings as rope_parameters={"rope_type", "rope_theta", ...} (and may mirror them in
    rope_scaling); 4.x writes rope_theta at top level and the scaling in rope_scaling."""
    out: dict[str, Any] = {"rope_scaling": None}
    for key in ("rope_scaling", "rope_parameters"):  # rope_parameters (5.x) wins over a 4.x mirror
        rope = cfg.get(key)
        if not rope:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{key}={rope!r} must be a JSON object (rope_type, rope_theta, ...)")
        rope = dict(rope)
        if "rope_theta" in rope:
            out["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{key}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
                             f"(RoPE over the whole head: 1.0)")
        rope.pop("partial_rotary_factor", None)
        if rope_type == "default":
            out["rope_scaling"] = None
            continue
        if rope_type in ("llama3", "yarn"):  # HF's default for a missing original context length
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)))
        out["rope_scaling"] = {"rope_type": rope_type, **rope}
    return out


def _window_fields_from_hf(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` (ModelArgs names) as HF builds them: Qwen2/Qwen3 slide
    only with ``use_sliding_window``, on ``layer_types`` (default: layers from ``max_window_layers``
    on); Qwen3-MoE (with ``use_sliding_window``) and Mixtral on every layer; Llama never."""
    if model_type == "llama" or (model_type != "mixtral" and not cfg.get("use_sliding_window")):
        return {"sliding_window": None, "layer_types": None}
    window = cfg.get("sliding_window", 4096 if model_type != "mixtral" else None)
    if window is None or model_type in MOE_TYPES:
        return {"sliding_window": window, "layer_types": None}
    n, first = cfg.get("num_hidden_layers", 0), cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"sliding_window": window, "layer_types": types}


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def _moe_fields_from_hf(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The HF config of an MoE model with its fields under ``ModelArgs`` names; layouts megarl does
    not implement (dense layers mixed in, router jitter) raise naming the field."""
    cfg = dict(cfg)
    if model_type == "qwen3_moe":
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"decoder_sparse_step={cfg['decoder_sparse_step']} is not supported: every layer "
                             f"must be sparse (decoder_sparse_step=1)")
        if cfg.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers={cfg['mlp_only_layers']} is not supported: every layer must be "
                             f"sparse (mlp_only_layers=[])")
        if "num_local_experts" in cfg:  # transformers 5.x saves Qwen3-MoE's expert count under this name
            cfg.setdefault("num_experts", cfg.pop("num_local_experts"))
        # HF's Qwen3MoeConfig defaults, for configs that leave them out.
        cfg.setdefault("num_experts", 128)
        cfg.setdefault("num_experts_per_tok", 8)
        cfg.setdefault("moe_intermediate_size", 768)
        cfg.setdefault("norm_topk_prob", False)
    else:  # mixtral
        if cfg.get("router_jitter_noise"):
            raise ValueError(f"router_jitter_noise={cfg['router_jitter_noise']} is not supported: the router "
                             f"must be deterministic (router_jitter_noise=0)")
        cfg["num_experts"] = cfg.get("num_local_experts", 8)
        cfg.setdefault("num_experts_per_tok", 2)
    return cfg
