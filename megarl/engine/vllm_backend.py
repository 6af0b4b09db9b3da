"""vLLM as the rollout backend (``rollout.backend: vllm``): the ``generate`` interface of
:class:`megarl.engine.Engine` over an in-process ``vllm.LLM``.

What the rollout stage and the weight sync use of an engine, and nothing more (so another
production engine, e.g. SGLang, can stand behind the same few calls): ``generate(requests, step,
on_finish)``, ``reset_stats``/``stats``, ``spec`` (megarl's speculator when its draft sources propose
through vLLM, else None: megarl/engine/vllm_spec.py), ``device``, and
for the weight sync ``model`` (HF-named tensors it writes into), ``tp_rank``/``tp_size``.

- Token ids in and out: prompts go in as ``TokensPrompt`` ids (vLLM starts without a tokenizer),
  responses come back as vLLM's sampled ids, the stop token included (docs/design.md §1.3).
- Every stop token is the request's ``stop_token_ids`` (``ignore_eos``: vLLM adds none of its own).
- Logprobs of the sampled tokens follow docs/design.md §1.3, ``log softmax(logits / T)`` with T = 0
  read as 1 and top-k/top-p not applied: vLLM's ``raw_logprobs`` are that for T in {0, 1};
  otherwise its ``processed_logprobs`` (after temperature, and after top-k/top-p, so the run's
  check refuses T not in {0, 1} together with top-k/top-p).
- Seeds: each sample's vLLM seed is a hash of (run seed, step, prompt uid, sample index), so a
  sample is a function of those as far as vLLM's seeded sampling is (measured in the tests; it
  is not the counter-based noise of docs/design.md §1.1, so samples differ from megarl's engine's
  at T > 0; greedy tokens agree).
- Generation runs on vLLM's step-level engine API (``LLMEngine.add_request``/``step``/
  ``abort_request``, in this process), so the rollout stage's scheduling works as on megarl's
  engine: each response is handed on right after the engine step that finished it (stream
  training), and generation can stop between steps (tail batching's short rounds).
- Several processes: each generating process runs its own vLLM (rollout TP 1, rollout DP = the
  generating processes). vLLM builds its process groups over the run's default group, i.e. over
  every process, together: with disaggregated placement the trainer-only processes make the same
  groups without a model, at the same point (megarl/engine/vllm_groups.py).
- Weights: the sync writes the trainer's weights into a staging copy under HF names (``model``,
  checked by the sync as any engine's are), then :meth:`push_weights` reloads them into vLLM's
  model in process (its worker's ``reload_weights``), checks what it can read back, and drops
  vLLM's prefix cache (it holds the old weights' keys and values).
"""
from __future__ import annotations

import gc
import hashlib
import struct
import time

import torch

from megarl.engine.requests import EngineConfig, Request, Result
from megarl.engine.vllm_groups import _vllm_env, check_group_count, llm_arguments
from megarl.engine.vllm_spec import SourceProposer, VLLMSpecConfig, speculative_config
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

class VLLMLoadError(RuntimeError):
    """vLLM's model does not hold the weights just synced into the staging copy."""


INSTALL_HINT = "install it with `make vllm` (pip install -e .[vllm]), or use rollout.backend=megarl"


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here (None: it can)."""
    _vllm_env()
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or the RuntimeError of a CUDA torchvision
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def sample_seed(run_seed: int, step: int, uid: int, sample_idx: int) -> int:
    """vLLM's per-request seed: 63 bits of a hash of (run seed, step, prompt uid, sample index)."""
    key = struct.pack("<4q", run_seed, step, uid, sample_idx)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class VLLMEngine:
    """A rollout engine backed by ``vllm.LLM`` (rollout TP 1; one per process). ``temperature``
    picks vLLM's logprob convention (``vllm_groups.logprobs_mode``): every request must then sample
    at it, or at 0. Speculation (megarl/engine/vllm_spec.py): ``spec``, megarl's ``Speculator`` whose draft
    sources propose through vLLM, or ``vllm_spec``, vLLM's own ngram/suffix methods."""

    def __init__(self, args: ModelArgs, cfg: EngineConfig, seed: int, temperature: float, spec=None,
                 vllm_spec: VLLMSpecConfig | None = None):
        missing = vllm_missing()
        if missing is not None:
            raise ValueError(f"rollout.backend=vllm but vLLM cannot be imported ({missing}); {INSTALL_HINT}")
        if cfg.dtype not in ("float32", "bfloat16") or cfg.device != "cpu":
            raise ValueError(f"the vLLM backend runs float32 or bfloat16 on cpu; got dtype={cfg.dtype}, "
                             f"device={cfg.device}")
        self.cfg, self.seed, self.args, self.temperature = cfg, seed, args, temperature
        if spec is not None and vllm_spec is not None and vllm_spec.method != "none":
            raise ValueError(f"the vLLM backend drafts with megarl's sources (spec.enabled) or with vLLM's "
                             f"rollout.vllm_spec.method={vllm_spec.method}, not both")
        self.spec, self.device, self.tp_rank, self.tp_size = spec, torch.device("cpu"), 0, 1
        self.spec_config = speculative_config(vllm_spec, spec.cfg.k_max if spec is not None else 0)
        self.requests: dict[str, Request] = {}  # vLLM request id -> request, while a generate call runs
        self._sampled_drafts = False  # T > 0 with drafts: refused (see generate); the tests measure why
        # The weight sync's target: HF-named tensors in vLLM's dtype, pushed into vLLM after each sync.
        self.model = CausalLM(args).to(cfg.torch_dtype).eval().requires_grad_(False)
        self.llm = self._start()
        self.proposer = None
        if spec is not None:  # vLLM built the proposer in its (in-process) model runner: hand it this engine
            self.proposer = self.llm.collective_rpc(_bind_proposer, args=(self,))[0]
        self.reset_stats()

    def _start(self):
        """The ``vllm.LLM`` (its arguments: :func:`llm_arguments`), once every process of the run
        agrees on the process groups made so far (vLLM makes its own over all of them:
        megarl/engine/vllm_groups.py)."""
        with llm_arguments(self.args, self.cfg, self.seed, self.temperature, self.spec_config) as kwargs:
            from vllm import LLM

            check_group_count()
            llm = LLM(**kwargs)
        # vLLM's engine core would shut down when garbage collected, destroying the default process
        # group (the run's, or one it made itself that the run joined): only close() does that.
        llm.llm_engine.engine_core._finalizer.detach()
        gc.unfreeze()  # vLLM froze the heap at start-up; this process's cyclic garbage is collected again
        return llm

    def close(self) -> None:
        """Shut vLLM's engine core down (it also destroys the process groups it joined, the default one
        included: call it after the run's last collective)."""
        self.llm.llm_engine.engine_core.engine_core.shutdown()

    def reset_stats(self) -> None:
        """``forwards``: vLLM engine steps; ``tokens``: tokens produced (as :class:`Engine`)."""
        self.stats = {"forwards": 0, "tokens": 0, "target_forwards": 0}

    def after_sync(self, sync):
        """``sync`` (a ``WeightSync``) followed by :meth:`push_weights`, as one callable with the
        sync's metrics plus ``vllm_load_s``."""
        def run() -> dict:
            metrics = sync()
            t0 = time.perf_counter()
            self.push_weights()
            return {**metrics, "vllm_load_s": time.perf_counter() - t0}
        return run

    @torch.no_grad()
    def push_weights(self) -> None:
        """Load the staged weights into vLLM's model (its worker's in-place ``reload_weights``), then
        check them. vLLM-CPU runs each linear (the LM head too) through a copy of its weight packed
        for oneDNN at load time; a tied LM head is not reloaded (it shares the embedding), so the
        layers that keep their weight are packed again here. Checks: every parameter vLLM keeps
        readable (embeddings, norms) holds its staged tensor bit for bit, and every packed linear
        computes ``x @ W.T`` of its staged ``W`` on a random ``x`` (to matmul rounding)."""
        staged = dict(self.model.state_dict())
        if self.args.tie_word_embeddings:
            staged.pop("lm_head.weight", None)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(staged.items()),
                                                          "is_checkpoint_format": True})
        rtol = 1e-4 if self.cfg.dtype == "float32" else 3e-2
        bad = self.llm.apply_model(lambda model: _repack_and_check(model, staged, self.args, rtol))[0]
        self.llm.reset_prefix_cache()  # its blocks hold the old weights' keys and values
        if bad:
            raise VLLMLoadError(f"vLLM's model does not hold the synced weights after loading: {bad[:8]}")

    def generate(self, requests: list[Request], step: int, progress: bool = False, purpose: str = "rollout",
                 on_finish=None, should_stop=None) -> list[Result]:
        """Responses for ``requests`` (same order), on vLLM's step-level engine API, as
        :meth:`megarl.engine.Engine.generate`: ``on_finish(i, result)`` is called for request ``i``
        between engine steps, right after the step that finished it (stream training trains its
        group there); ``should_stop()`` is asked before every engine step (tail batching's short
        rounds), and once it says yes the unfinished requests are aborted in vLLM and returned as
        they stand, ``finish_reason`` ``"aborted"`` (their tokens a prefix of the full response: a
        sample is a function of its seed, docs/design.md §1.1). Which requests finish by which step
        depends only on the requests (vLLM's scheduler runs in this process, on engine steps, not
        on time), so a stop is repeatable. With drafts (``spec``) the speculator sees the call's
        requests and results, as on megarl's engine."""
        if purpose != "rollout":
            raise ValueError(f"the vLLM backend does not pre-generate drafts (purpose={purpose!r}); valid: "
                             f"purpose='rollout' (spec.bubble_pregen is refused with rollout.backend=vllm)")
        params = [self._params(i, r, step) for i, r in enumerate(requests)]  # every request checked before any starts
        eng = self.llm.llm_engine
        for i, (r, sp) in enumerate(zip(requests, params)):
            self.requests[eng.add_request(str(i), _prompt(r), sp)] = r
        if self.spec is not None:
            self.spec.begin(requests, step)
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        results: list[Result | None] = [None] * len(requests)
        n_forwards = [0] * len(requests)  # engine steps that gave the request tokens (several with drafts)
        try:
            while eng.has_unfinished_requests():
                if should_stop is not None and should_stop():
                    eng.abort_request([str(i) for i, res in enumerate(results) if res is None])
                    break
                self.stats["forwards"] += 1
                for out in eng.step():  # DELTA outputs: this step's new tokens of each request that made some
                    i, c = int(out.request_id), out.outputs[0]
                    n_forwards[i] += bool(c.token_ids)
                    tokens[i] += c.token_ids
                    logprobs[i] += [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)]
                    if out.finished:
                        results[i] = res = _result(requests[i], tokens[i], logprobs[i], c.finish_reason, n_forwards[i])
                        self.stats["tokens"] += len(res.tokens)
                        self.stats["target_forwards"] += res.n_forwards
                        if on_finish is not None:
                            on_finish(i, res)
        finally:
            self.requests = {}
            if self.proposer is not None:
                self.proposer.forget()
        for i, res in enumerate(results):
            if res is None:  # aborted by should_stop: never handed to on_finish (as megarl's engine)
                results[i] = _result(requests[i], tokens[i], logprobs[i], "abort", n_forwards[i])
        if self.spec is not None:
            self.spec.end(results, step, purpose)
        return results

    def pregenerate(self, requests: list[Request], step: int, coupled: bool = True,
                    should_stop=None) -> list[Result]:
        """Bubble drafts are not made on this backend: refused with ``generate``'s error for
        ``purpose='bubble'`` (the rollout backend interface, megarl/rollout/backend.py)."""
        return self.generate(requests, step, purpose="bubble", should_stop=should_stop)

    def _params(self, i: int, r: Request, step: int):
        """vLLM's ``SamplingParams`` of request ``i`` (see the module docstring)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        p = r.params
        if p.temperature > 0 and self.spec_config is not None and not self._sampled_drafts:
            raise ValueError(f"request {i}: temperature {p.temperature} with drafts; vLLM-CPU's rejection sampler "
                             f"does not keep the target distribution (docs/rollout_backends.md): use temperature 0")
        if p.temperature not in (0.0, self.temperature):
            raise ValueError(f"request {i}: temperature {p.temperature}, but this vLLM engine reports logprobs "
                             f"for temperature {self.temperature} (or 0)")
        return VSP(temperature=p.temperature, top_k=p.top_k or -1, top_p=p.top_p, max_tokens=p.max_new_tokens,
                   stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
                   seed=sample_seed(self.seed, step, r.uid, r.sample_idx), output_kind=RequestOutputKind.DELTA)


def _prompt(r: Request):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(r.prompt_ids))


def _bind_proposer(worker, backend) -> SourceProposer:
    """In vLLM's worker: hand its ``custom_class`` proposer the backend (and the model runner, whose
    batch order the proposer reads)."""
    runner = worker.model_runner
    runner.drafter.bind(runner, backend)
    return runner.drafter


def _result(req: Request, tokens: list[int], logprobs: list[float], vllm_reason: str | None,
            n_forwards: int) -> Result:
    """A megarl ``Result`` from a request's tokens and logprobs (``n_forwards``: the engine steps
    that gave it tokens); vLLM's finish reason other than ``stop``/``length`` (an abort) reads
    ``aborted``."""
    reason = {"stop": "stop", "length": "length"}.get(vllm_reason, "aborted")
    return Result(uid=req.uid, sample_idx=req.sample_idx, prompt_ids=list(req.prompt_ids), tokens=list(tokens),
                  logprobs=list(logprobs), entropies=[], finish_reason=reason, n_forwards=n_forwards,
                  temperature=req.params.temperature)


def _repack_and_check(model, staged: dict[str, torch.Tensor], args: ModelArgs, rtol: float) -> list[str]:
    """In vLLM's worker, after a reload: pack again the layers whose packed copy the reload does not
    redo (those that keep their weight), and the names of the parameters and packed layers that do
    not hold the staged weights (see :meth:`VLLMEngine.push_weights`)."""
    bad = [name for name, p in model.named_parameters()
           if p.numel() and not _holds(p.data, _expected(name, staged, args))]
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and weight.numel():
            module.quant_method.process_weights_after_loading(module)
        want = _expected(f"{name}.weight", staged, args)
        x = torch.randn(3, want.shape[1], generator=gen).to(want.dtype)
        ref = (x.float() @ want.float().t())
        got = module.cpu_linear(x, module.weight, None)[:, :want.shape[0]].float()
        if not (got - ref).abs().max() <= rtol * ref.abs().max():
            bad.append(f"{name} (packed)")
    return bad


def _holds(param: torch.Tensor, want: torch.Tensor) -> bool:
    """``param`` holds ``want`` bit for bit; vLLM pads the vocabulary rows of its embedding and LM
    head (to a multiple of 64), and those extra rows are never read for a real token."""
    if param.shape[1:] == want.shape[1:] and param.shape[0] > want.shape[0]:
        param = param[:want.shape[0]]
    return param.shape == want.shape and param.dtype == want.dtype and torch.equal(param, want)


def _expected(name: str, staged: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """What vLLM's Llama-family parameter ``name`` must hold: the staged HF tensor, or the
    concatenation vLLM fuses (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([staged[name.replace(fused, part)] for part in parts])
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return staged["model.embed_tokens.weight"]
    return staged[name]
