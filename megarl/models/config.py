"""Model architecture description shared by the engine, the trainer and the converter.

It is read from (and written to) a Hugging Face ``config.json``, so that the HF config is the
single source of truth for shapes wherever a model is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# HF ``architectures`` entries of the decoder family that megarl's plain-torch model covers.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelArgs:
    """Shapes and options of a Llama/Qwen2-family decoder (HF ``config.json`` field names)."""

    vocab_size: int
    """Number of rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """Width of the SwiGLU MLP's gate/up projections."""
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
    max_position_embeddings: int = 2048
    """Longest sequence the model is configured for."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Whether q/k/v projections carry a bias (Qwen2 always does)."""
    model_type: str = "qwen2"
    """``llama`` or ``qwen2``."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the tokenizer has one."""
    eos_token_id: int | None = None
    """End-of-sequence token id: generation stops when it is sampled."""
    pad_token_id: int | None = None
    """Padding token id (never sampled by megarl; kept for HF round trips)."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; valid choices: "
                f"{sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

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
        # transformers >= 5 writes RoPE settings as rope_parameters={"rope_type", "rope_theta", ...}
        # (and may mirror them in rope_scaling); 4.x writes rope_theta at top level.
        for key in ("rope_parameters", "rope_scaling"):
            rope = cfg.get(key)
            if not rope:
                continue
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"{key}={rope!r} is not supported yet (plain RoPE only: rope_type 'default')")
            if "rope_theta" in rope:
                cfg["rope_theta"] = rope["rope_theta"]
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
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
        if self.model_type == "qwen2":
            cfg.pop("attention_bias")  # Qwen2 always has qkv bias; HF's config has no such field
            cfg["use_sliding_window"] = False
        else:
            cfg["mlp_bias"] = False
        return cfg
