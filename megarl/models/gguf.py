"""GGUF -> Hugging Face folder (``megarl convert gguf-to-hf``), read with llama.cpp's own ``gguf`` package.

A GGUF file carries everything a HF folder does: the weights (often quantised), the architecture
in ``<arch>.*`` metadata, and the tokenizer (``tokenizer.ggml.*``: vocabulary, BPE merges, special
token ids, the chat template). The conversion writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (dequantised), ``tokenizer.json`` and ``tokenizer_config.json`` (with the
chat template), atomically.

Two things a generic loader gets wrong, and why this module builds the tokenizer itself:
- ``transformers``' GGUF tokenizer conversion adds the BOS token to every encoding and, for a
  llama GGUF, names the BOS token as EOS. SmolLM2's own tokenizer adds no BOS and stops at
  ``<|im_end|>``. Here the post-processor adds BOS only when ``tokenizer.ggml.add_bos_token`` says
  so, and bos/eos/pad come from their own ids.
- The pre-tokenizer is not stored in a GGUF, only its name (``tokenizer.ggml.pre``), so only
  names whose Hugging Face pre-tokenizer is known exactly are converted (``PRE_TOKENIZERS``);
  others fail naming the supported ones.

Weights: llama.cpp stores a Llama model's q/k projection rows permuted (its RoPE pairs adjacent
dimensions; HF's pairs halves); :func:`unpermute_qk` undoes it. Qwen2/Qwen3 GGUFs are not
permuted. Quantised tensors are dequantised to float32 by ``gguf.quants.dequantize``; the result
is the quantised model exactly, not the original bf16 checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from megarl.models.config import ModelArgs
from megarl.models.hf_io import save_hf_model

# GGUF architecture -> megarl/HF model type. Llama's q/k rows are permuted by llama.cpp's converter.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_QK = ("llama",)
# Tokenizer models megarl converts: byte-level BPE ("gpt2" in llama.cpp's terms).
TOKENIZER_MODELS = ("gpt2",)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _pre_smollm():
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit split off on its own (regex \p{N}),
    # then GPT-2's byte-level regex: exactly SmolLM/SmolLM2's tokenizer.json pre-tokenizer.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _pre_gpt2():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> the HF pre-tokenizer it stands for.
PRE_TOKENIZERS: dict[str, Callable] = {"smollm": _pre_smollm, "gpt-2": _pre_gpt2, "default": _pre_gpt2}


class GGUFError(ValueError):
    """A GGUF file megarl cannot convert (names the file and what is unsupported)."""


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: it stores each head's rows as (pairs, 2) where HF has
    (2, pairs), i.e. ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is that map's inverse."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """Metadata and tensors of one GGUF file (``gguf.GGUFReader`` underneath; memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError/struct.error on a file that is not GGUF
            raise GGUFError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    @property
    def arch(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
        return arch

    def model_args(self) -> ModelArgs:
        a = self.arch
        n_head = int(self.require(f"{a}.attention.head_count"))
        hidden = int(self.require(f"{a}.embedding_length"))
        names = {t.name for t in self.reader.tensors}
        if self.get(f"{a}.rope.scaling.type") not in (None, "none"):
            raise GGUFError(f"{self.path}: RoPE scaling {self.get(f'{a}.rope.scaling.type')!r} is not supported "
                            f"(plain RoPE only)")
        tokens = self.require("tokenizer.ggml.tokens")
        head_dim = self.get(f"{a}.attention.key_length") or self.get(f"{a}.rope.dimension_count")
        return ModelArgs(
            vocab_size=int(self.get(f"{a}.vocab_size") or len(tokens)), hidden_size=hidden,
            intermediate_size=int(self.require(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self.require(f"{a}.block_count")), num_attention_heads=n_head,
            num_key_value_heads=int(self.get(f"{a}.attention.head_count_kv") or n_head),
            head_dim=int(head_dim) if head_dim else None,
            # GGUF keeps it as float32 (1e-5 reads 9.99999974e-06): its shortest float32 repr is the original.
            rms_norm_eps=float(str(np.float32(self.require(f"{a}.attention.layer_norm_rms_epsilon")))),
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.require(f"{a}.context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=a == "llama" and "blk.0.attn_q.bias" in names,
            model_type=ARCHITECTURES[a],
            bos_token_id=self._token_id("bos"), eos_token_id=self._token_id("eos"),
            pad_token_id=self._token_id("padding"),
        )

    def _token_id(self, kind: str) -> int | None:
        v = self.get(f"tokenizer.ggml.{kind}_token_id")
        return None if v is None else int(v)

    def state_dict(self, args: ModelArgs, progress: bool = False) -> dict[str, torch.Tensor]:
        """HF-named float32 tensors, dequantised, q/k rows in HF's order."""
        import gguf
        from tqdm.auto import tqdm

        out = {}
        permuted = self.arch in _PERMUTED_QK
        for t in tqdm(self.reader.tensors, desc="dequantise", disable=not progress):
            name = _hf_name(t.name)
            if name is None:
                raise GGUFError(f"{self.path}: tensor {t.name!r} has no Hugging Face counterpart megarl knows "
                                f"(architecture {self.arch!r})")
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if permuted and name.endswith("q_proj.weight"):
                w = unpermute_qk(w, args.num_attention_heads)
            elif permuted and name.endswith("k_proj.weight"):
                w = unpermute_qk(w, args.num_key_value_heads)
            out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # (a writable copy)
        return out

    def write_tokenizer(self, out_dir: Path, model_max_length: int) -> None:
        """``tokenizer.json`` (byte-level BPE, the GGUF's vocabulary and merges, its pre-tokenizer)
        and ``tokenizer_config.json`` (special tokens, chat template, BOS added only if the GGUF says so)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors

        kind = self.require("tokenizer.ggml.model")
        if kind not in TOKENIZER_MODELS:
            raise GGUFError(f"{self.path}: tokenizer model {kind!r} is not supported; supported: "
                            f"{list(TOKENIZER_MODELS)} (byte-level BPE)")
        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{self.path}: pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
        tokens = list(self.require("tokenizer.ggml.tokens"))
        types = list(self.require("tokenizer.ggml.token_type"))
        merges = [tuple(m.split(" ", 1)) for m in self.require("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   byte_fallback=False))
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        # 3 = control, 4 = user-defined (llama.cpp's token types): never split, never merged.
        special = [tokens[i] for i, ty in enumerate(types) if ty in (3, 4)]
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
        bos = self._token_id("bos")
        add_bos = bool(self.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        if add_bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.save(str(out_dir / "tokenizer.json"))
        names = {"bos_token": self._token_id("bos"), "eos_token": self._token_id("eos"),
                 "pad_token": self._token_id("padding"), "unk_token": self._token_id("unknown")}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
                  **{k: tokens[v] for k, v in names.items() if v is not None},
                  "additional_special_tokens": [s for s in special if s not in
                                                {tokens[v] for v in names.values() if v is not None}]}
        template = self.get("tokenizer.chat_template")
        if template:
            config["chat_template"] = template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32",
               progress: bool = True) -> Path:
    """Convert ``gguf_path`` into the HF folder ``out_dir`` (written atomically; an existing folder
    is replaced). ``dtype``: the safetensors' dtype (``float32`` keeps the dequantised values exactly)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is invalid; valid choices: ['float32', 'bfloat16']")
    f = GGUFFile(gguf_path)
    args = f.model_args()
    sd = {k: v.to(getattr(torch, dtype)) for k, v in f.state_dict(args, progress).items()}

    def extra(tmp: Path) -> None:
        f.write_tokenizer(tmp, args.max_position_embeddings)
        gen = json.loads((tmp / "generation_config.json").read_text())
        eot = f._token_id("eot")  # chat models' end-of-turn, when it is not the EOS: both stop
        if eot is not None and eot != args.eos_token_id:
            gen["eos_token_id"] = [args.eos_token_id, eot]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    return save_hf_model(sd, args, out_dir, write_extra=extra)
