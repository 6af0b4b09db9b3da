"""The learned drafter (EAGLE, trained on idle ranks as in TLT; docs/design.md §6): one decoder layer that
reads the target's last hidden states and the token embeddings and predicts the target's next
hidden state, from which the target's own (frozen) LM head gives next-token logits.

Indexing (EAGLE): the target's hidden state ``f_i`` at sequence index i predicts token
``s[i+1]``. The drafter's input at i is ``fc(concat(embed(s[i+1]), f_i))``; its output is the
predicted ``f_{i+1}``. Drafting continues the chain on its own predictions: the predicted
feature and the token drafted from it are the next input. The engine hands over, per forward,
the pairs ``(f_i, s[i+1])`` its accepted rows produced (``FeatureRing``); the drafter attends to
the last ``window`` of them before its chain.

Exactness (docs/design.md §1): draft token j of request (uid, i) is ``argmax(filter(l/T) + g)``, with
``l`` the drafter's logits and ``g`` the counter-based noise of (seed, step, uid, i, position):
the very noise the target's sampler uses at that position. It is a coupled sample (accepted
wherever drafter and target agree under the same noise), and verification, unchanged, keeps
the output token-identical whatever the drafter proposes.

The drafter reuses megarl's model blocks (``DecoderLayer``, ``RMSNorm``, ``attention``) with the
target's architecture (one dense layer; an MoE target gets a dense layer of ``intermediate_size``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from megarl.engine.sampling_rows import SamplingRows
from megarl.models.config import ModelArgs
from megarl.models.llama import DecoderLayer, RMSNorm, attention, rope_cos_sin
from megarl.utils.fs import atomic_dir, safetensors_os_errors

ARCHITECTURE = "MegarlEagleDrafter"
WEIGHTS = "model.safetensors"
_DENSE_OF = {"qwen3_moe": "qwen3", "mixtral": "llama"}


def drafter_args(target: ModelArgs) -> ModelArgs:
    """The drafter layer's shapes: the target's, one layer, dense."""
    return dataclasses.replace(target, num_hidden_layers=1,
                               model_type=_DENSE_OF.get(target.model_type, target.model_type),
                               num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=None,
                               sliding_window=None, layer_types=None)  # the drafter's own band (_Attn) limits it


class _Attn:
    """Attention backend of the drafter's layer: causal within a band of ``band`` keys, over
    padded rows (``valid`` [B, T]: False = padding), and, in drafting, over the keys of earlier
    calls (a chain step adds one row and attends to everything before it)."""

    def __init__(self, valid: torch.Tensor, band: int | None = None, keep: bool = False):
        self.valid, self.band, self.keep = valid, band, keep
        self.k = self.v = None

    def __call__(self, layer_idx, q, k, v):
        if self.keep and self.k is not None:
            k, v = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
            self.valid = torch.cat([self.valid, torch.ones(q.shape[0], q.shape[1], dtype=torch.bool,
                                                           device=q.device)], 1)
        if self.keep:
            self.k, self.v = k, v
        tq, tk = q.shape[1], k.shape[1]
        qi = torch.arange(tk - tq, tk, device=q.device)[:, None]
        ki = torch.arange(tk, device=q.device)[None, :]
        causal = ki <= qi
        if self.band is not None:
            causal = causal & (qi - ki < self.band)
        # a padded query attends to itself only (its output is never used; no all-masked rows)
        mask = (causal[None] & self.valid[:, None, :]) | (ki == qi)[None]
        return attention(q, k, v, mask)


class Drafter(nn.Module):
    """EAGLE drafter: ``fc`` (2H -> H), one ``DecoderLayer``, an output ``norm`` (the target's
    features are final-norm hidden states). Embedding and LM head are the target's, passed in
    at call time (frozen, never copied: after a weight sync the drafter reads the new ones)."""

    def __init__(self, target: ModelArgs, window: int = 8):
        super().__init__()
        self.args, self.window = drafter_args(target), window
        h = target.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(self.args, 0)
        self.norm = RMSNorm(h, target.rms_norm_eps)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attn: _Attn) -> torch.Tensor:
        """Predicted next features [B, T, H] from features and next-token embeddings [B, T, H]."""
        x = self.fc(torch.cat([embeds, feats], -1))
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype, self.args.rope_scaling)
        return self.norm(self.layer(x, cos, sin, attn))

    def predict(self, feats, tokens, embed_w, valid=None) -> torch.Tensor:
        """Teacher-forced predictions over whole segments (training): feats [B, T, H], tokens
        [B, T] (``tokens[:, j]`` follows ``feats[:, j]``), rows right-padded (``valid``)."""
        b, t = tokens.shape
        valid = valid if valid is not None else torch.ones(b, t, dtype=torch.bool, device=tokens.device)
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        return self(feats, F.embedding(tokens, embed_w), pos, _Attn(valid, band=self.window))

    @torch.no_grad()
    def draft(self, feats, tokens, valid, k: int, embed_w, head, rows: SamplingRows) -> torch.Tensor:
        """A chain of ``k`` draft tokens [B, k] after the windows ``feats`` [B, W, H] / ``tokens``
        [B, W] (left-padded: ``valid``), each sampled with the request's own noise. ``head``: the
        target's LM head, hidden states [B, H] -> logits [B, V]. ``rows``: the requests' sampling
        set-up, ``rows.position`` the response position of the first draft token; the logits are
        sampled in its temperature's dtype (the target's sampling dtype)."""
        b, w = tokens.shape
        dev = tokens.device
        attn = _Attn(valid, keep=True)
        pos = torch.arange(w, device=dev).expand(b, w)
        x_feat, x_emb = feats, F.embedding(tokens, embed_w)
        out = []
        for j in range(k):
            pred = self(x_feat, x_emb, pos, attn)[:, -1:]  # [B, 1, H]
            logits = head(pred[:, 0]).to(rows.temperature.dtype)
            # the sampler's token (hashing only the tokens that can still win: the dense noise
            # over the vocabulary was most of a chain step at SmolLM2's 49k tokens)
            tok = rows.shifted(j).sample(logits)
            out.append(tok)
            x_feat, x_emb = pred, F.embedding(tok[:, None], embed_w)
            pos = torch.full((b, 1), w + j, device=dev, dtype=torch.int64)
        return torch.stack(out, 1)


# ------------------------------------------------------------------ export / import
def save_drafter(drafter: Drafter, out_dir: str | os.PathLike) -> Path:
    """``config.json`` + ``model.safetensors`` of the drafter's own weights (not the target's
    embedding and head), written atomically (temporary folder renamed into place)."""
    sd = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    cfg = {"architectures": [ARCHITECTURE], "window": drafter.window,
           "layer_config": drafter.args.to_hf_config(torch_dtype=dtype)}
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        with safetensors_os_errors(tmp / WEIGHTS):
            save_file(sd, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return Path(out_dir)


def load_drafter(path: str | os.PathLike, target: ModelArgs, dtype: torch.dtype = torch.float32) -> Drafter:
    """A drafter saved by :func:`save_drafter`, checked against the target it will serve."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"drafter folder {path} needs config.json and {WEIGHTS}")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"drafter folder {path}: architectures={cfg.get('architectures')}, "
                         f"expected [{ARCHITECTURE!r}]")
    saved = ModelArgs.from_hf_config(cfg["layer_config"])
    want = drafter_args(target)
    for f in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(saved, f) != getattr(want, f):
            raise ValueError(f"drafter folder {path} was made for another target: {f}={getattr(saved, f)}, "
                             f"the target has {getattr(want, f)}")
    drafter = Drafter(target, window=int(cfg["window"])).to(dtype)
    sd = load_file(str(path / WEIGHTS))
    own = drafter.state_dict()
    if set(sd) != set(own) or any(sd[k].shape != own[k].shape for k in own):
        raise ValueError(f"drafter folder {path}: tensors {sorted(sd)} do not fit the drafter ({sorted(own)})")
    with torch.no_grad():
        for k, v in sd.items():
            own[k].copy_(v)
    return drafter
