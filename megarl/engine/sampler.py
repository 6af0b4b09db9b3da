"""Counter-based Gumbel-max sampler (docs/design.md §1, the exactness contract).

A sampled token is ``argmax(filter(logits / T) + g)`` where the Gumbel noise ``g[v]`` is a pure
function of the key (run seed, RL step, prompt uid, sample index, position, v). No stateful
generator is involved, so a response does not depend on batch composition, scheduling or
speculation, and a Triton kernel can regenerate the same noise bit for bit.

Exact noise formula (everything is unsigned 32-bit arithmetic; the torch code emulates it in
int64 tensors masked to 32 bits)::

    key words (uint32): w = [seed & M, (seed >> 32) & M, step & M,
                             uid & M, (uid >> 32) & M, sample_idx & M, position & M, v]
                        (M = 0xFFFFFFFF; uid is taken as a 64-bit two's-complement integer)
    h = MurmurHash3_x86_32 of the 32-byte little-endian message w[0..7], murmur seed 0:
        h = 0
        for k in w:
            k = k * 0xCC9E2D51; k = rotl32(k, 15); k = k * 0x1B873593
            h = h ^ k; h = rotl32(h, 13); h = h * 5 + 0xE6546B64
        h = h ^ 32                                    # message length in bytes
        h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
    u = float32(h >> 9) * 2**-23 + 2**-24            # every step exact in fp32
    g = -det_log(-det_log(u))                         # float32, megarl/engine/detmath.py;
                                                      # "-" flips the sign bit (-0.0 stays exact)
    noise = g cast to the logits dtype

``u`` uses the 23 high bits of ``h`` (not 24): with 24 bits the half-step offset needs 25
significant bits, so fp32 rounds the largest ``u`` to exactly 1.0 and ``g`` becomes +inf
(about 1% of rows at a 150k vocab). With 23 bits ``u`` lies exactly on the grid
``(2j+1) / 2**24`` inside (0, 1), so ``g`` is finite in [-2.82, 16.7]. ``det_log`` is a log
made of correctly rounded basic float ops only, so torch (CPU or CUDA) and the Triton verify
kernel compute the same noise bits (``torch.log`` differs across backends in the last ulp).

Filters (every step is exact or correctly rounded, so backends agree bit for bit). With
``s = logits / T`` in the logits' dtype (T = 0 rows use T = 1) and tokens ranked by
(s descending, token id ascending):

- top-k (k > 0): keep v iff fewer than k tokens rank above v.
- top-p (p < 1, p taken in float64): ``w_v = det_exp(float32(s_v - max(s)))`` (exactly 1 at the
  top token), ``q_v = floor(w_v * 2**24)`` as an integer for tokens kept by top-k, else 0
  (NaN w counts 0); ``Z = sum q``; ``A_v`` = sum of ``q_u`` over tokens u ranked strictly above
  v. Keep v iff it is kept by top-k and (``A_v < p * Z`` in float64, or v has rank 0). Integer
  sums are exact in any order, unlike a float cumsum of softmax probabilities, so a sorted
  torch reference and a sort-free kernel select the same nucleus. ``q_v / 2**24`` is token v's
  probability relative to the top token, truncated to a multiple of 2**-24, so tokens below
  2**-24 of the top one never join a nucleus with p < 1.

``position`` is the index of the generated token within the response (0 = first generated
token), so the prompt length never enters the noise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megarl.engine.detmath import det_exp, det_log
from megarl.rl.temperature import scoring_temperature

try:  # the fused C++ twin of sample_keyed's noise and argmax (csrc/keyed_gumbel.cpp)
    from megarl import _keyed_gumbel as _native
    _NATIVE_ERROR: str | None = None
except ImportError as e:  # not built (no compiler / no pybind11) or built for another Python
    _native, _NATIVE_ERROR = None, str(e)

USE_NATIVE = True
"""Whether ``sample_keyed`` uses the C++ kernel on CPU when it is built (tests turn it off to
compare with the torch path; both give the same tokens)."""
NATIVE_VECTOR = True
"""Whether the C++ kernel takes its AVX-512 path where the CPU has it (``_native.avx512``); tests
turn it off to run its scalar path too. All paths give the same tokens."""
_warned = False
log = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_N = 0xE6546B64


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its response."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax of the raw logits, no noise)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns the filter off."""
    top_p: float = 1.0
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches
    top_p (at least one token); 1.0 turns the filter off."""
    max_new_tokens: int = 256
    """Longest response, in generated tokens (the stop token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after one of these tokens is sampled; the token is kept in the output.
    The engine adds nothing here: list the model's EOS explicitly."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} is invalid; valid range: >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid; valid range: int >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is invalid; valid range: (0, 1] (1.0 = off)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is invalid; valid range: int >= 1")
        stop = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid; valid: tuple of ints >= 0")
        object.__setattr__(self, "stop_token_ids", stop)


# ---------------------------------------------------------------------------------------------
# Counter-based Gumbel noise
# ---------------------------------------------------------------------------------------------

def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32, split into 16-bit halves of c so that no int64
    intermediate overflows (signed overflow is not something to rely on)."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _scramble(k: torch.Tensor) -> torch.Tensor:
    """Murmur3's per-block key scramble."""
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One murmur3 body round: fold the 32-bit word k into the state h."""
    h = _rotl32(h ^ _scramble(k), 13)
    return (h * 5 + _N) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def _row_state(seed: int, step: int, prompt_uid: torch.Tensor, sample_idx: torch.Tensor,
               position: torch.Tensor) -> torch.Tensor:
    """The murmur state [N] after the 7 per-row key words (everything but the token id)."""
    seed &= (1 << 64) - 1
    dev = prompt_uid.device
    uid = prompt_uid.to(torch.int64)
    words = [
        torch.full_like(uid, seed & _M32),
        torch.full_like(uid, seed >> 32),
        torch.full_like(uid, step & _M32),
        uid & _M32,
        (uid >> 32) & _M32,
        sample_idx.to(dev, torch.int64) & _M32,
        position.to(dev, torch.int64) & _M32,
    ]
    h = torch.zeros_like(uid)
    for w in words:  # per-row prefix of the message: O(N) work
        h = _absorb(h, w)
    return h


def _finish(h: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The last body round (the token id word) and the finalisation; h and token broadcast."""
    h = _rotl32(h ^ _scramble(token), 13)
    h = (h * 5 + _N) & _M32
    return _fmix32(h ^ 32)


def _gumbel(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u = (h >> 9).to(torch.float32) * (2.0 ** -23) + (2.0 ** -24)
    return (-det_log(-det_log(u))).to(dtype)


def noise_hash(seed: int, step: int, prompt_uid: torch.Tensor, sample_idx: torch.Tensor,
               position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The raw 32-bit hash h (as int64 in [0, 2**32)) of every (row, v), shape [N, V]."""
    h = _row_state(seed, step, prompt_uid, sample_idx, position)
    # Last word is the token id; only this part is O(N * V).
    return _finish(h[:, None], torch.arange(vocab_size, dtype=torch.int64, device=h.device)[None, :])


def gumbel_noise(seed: int, step: int, prompt_uid: torch.Tensor, sample_idx: torch.Tensor,
                 position: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard Gumbel noise [N, V] keyed by (seed, step, uid, sample_idx, position, v).

    ``prompt_uid``, ``sample_idx``, ``position`` are int tensors [N] on the target device.
    See the module docstring for the exact formula."""
    return _gumbel(noise_hash(seed, step, prompt_uid, sample_idx, position, vocab_size), dtype)


# Bounds of every noise value g: u lies in [2**-24, 1 - 2**-24], so the true -log(-log(u)) lies in
# [-2.8116, 16.6355], and det_log is within 2 ulp of the true log. The bounds below keep a wide
# margin; tests/engine/test_sampler.py checks all 2**23 possible noise values against them.
NOISE_LO, NOISE_HI = -2.82, 16.7
PROBE = 16
"""Highest logits per row whose exact scores bound the candidates of ``sample_keyed``."""


# ---------------------------------------------------------------------------------------------
# Filtering and sampling
# ---------------------------------------------------------------------------------------------

def _as_col(x, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Scalar or [N] tensor -> [N, 1] tensor (per-row sampling parameters)."""
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.reshape(-1, 1).expand(n, 1) if t.numel() == 1 else t.reshape(n, 1)


def _effective_temperature(temperature, n: int, dtype, device) -> torch.Tensor:
    """Per-row temperature [N, 1] with greedy rows (T=0) read as T=1 (for logprob/entropy)."""
    return scoring_temperature(_as_col(temperature, n, dtype, device))


def filter_logits(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """``logits / T`` with tokens outside the top-k set and the top-p nucleus set to -inf.

    Each parameter is a scalar or a tensor [N] (one value per row). T=0 rows are scaled by 1
    (the caller takes their argmax anyway). Top-k is applied first, then top-p on the
    renormalised top-k distribution (the HF / vLLM order), with the exact integer criterion of
    the module docstring. Ties rank by token id (a stable sort): the kept set is deterministic.
    With every T = 1 and no filter on, the result is ``logits`` itself, not a copy."""
    n, vocab = logits.shape
    dev = logits.device
    t = _effective_temperature(temperature, n, logits.dtype, dev)
    # x / 1 is x exactly: at T = 1 (the RL default) skip a pass over [N, V]
    scaled = logits if bool((t == 1).all()) else logits / t
    k = _as_col(top_k, n, torch.int64, dev)
    p = _as_col(top_p, n, torch.float64, dev)
    k_on, p_on = k > 0, p < 1.0
    if not bool((k_on | p_on).any()):  # nothing to filter: skip the O(V log V) sort
        return scaled
    sorted_s, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    keep = ~k_on | (rank < k)
    if bool(p_on.any()):
        w = det_exp((sorted_s - sorted_s[:, :1]).to(torch.float32))
        q = (w * 2.0 ** 24).to(torch.int64)  # w in [0, 1]: truncation is floor
        q = torch.where(keep & ~torch.isnan(w), q, 0)
        z = q.sum(-1, keepdim=True)
        above = torch.cumsum(q, dim=-1) - q  # exact integer mass of strictly higher-ranked tokens
        # top_p = 1 is "off" explicitly (p * Z = Z would still drop tokens with q = 0)
        keep = keep & (~p_on | (above.to(torch.float64) < p * z.to(torch.float64)) | (rank == 0))
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))


class SampleOutput(NamedTuple):
    tokens: torch.Tensor
    """Sampled token ids [N] (int64)."""
    logprobs: torch.Tensor
    """log softmax(logits / T) of the sampled token [N] (unfiltered; T=1 for greedy rows)."""
    entropies: torch.Tensor
    """Entropy of softmax(logits / T) [N] (unfiltered; T=1 for greedy rows)."""


def sample(logits: torch.Tensor, noise: torch.Tensor, temperature, top_k=0, top_p=1.0) -> SampleOutput:
    """Gumbel-max sampling of one token per row of ``logits`` [N, V] with ``noise`` [N, V].

    Greedy rows (T=0) take ``argmax(logits)``; the others ``argmax(filter(logits/T) + noise)``.
    argmax ties resolve to the lowest token id. Parameters are scalars or tensors [N]."""
    n = logits.shape[0]
    t = _as_col(temperature, n, logits.dtype, logits.device)
    greedy_tok = torch.argmax(logits, dim=-1)
    sampled_tok = torch.argmax(filter_logits(logits, temperature, top_k, top_p) + noise, dim=-1)
    tokens = torch.where(t[:, 0] == 0, greedy_tok, sampled_tok)
    return SampleOutput(tokens, *token_stats(logits, temperature, tokens))


def _native_ok(s: torch.Tensor) -> bool:
    """Whether the C++ kernel can take these scores (built, CPU, float32/float64, switched on)."""
    global _warned
    if not USE_NATIVE or s.device.type != "cpu" or s.dtype not in (torch.float32, torch.float64):
        return False
    if _native is None:
        if not _warned:
            _warned = True
            log.warning("The fused CPU sampler (megarl._keyed_gumbel) is not built (%s); sampling uses the "
                        "slower torch path, which gives the same tokens. Build it with `pip install "
                        "--no-build-isolation -e .` (needs pybind11 and a C++17 compiler).", _NATIVE_ERROR)
        return False
    return True


def _pruned_argmax(s: torch.Tensor, hi: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The torch path of ``sample_keyed`` after filtering: exact scores of the candidates only."""
    v = s.shape[1]
    dev, dtype = s.device, s.dtype
    # The exact scores of the PROBE highest logits of a row: their best, ``best``, is reached by
    # the winner, so only tokens with fl(s_v + hi) >= best can win (see sample_keyed).
    top = s.topk(min(PROBE, v), dim=-1).indices
    best = (s.gather(1, top) + _gumbel(_finish(state[:, None], top), dtype)).max(dim=-1, keepdim=True).values
    cand = ((s + hi) >= best) | torch.isnan(s.max(dim=-1, keepdim=True).values)  # NaN rows: every token
    if int(torch.count_nonzero(cand)) * 4 > cand.numel():
        # Flat rows (e.g. random weights): most tokens are candidates, and hashing the dense
        # [N, V] block is cheaper than gathering and scattering the candidates' indices.
        vocab = torch.arange(v, dtype=torch.int64, device=dev)
        return torch.argmax(s + _gumbel(_finish(state[:, None], vocab[None, :]), dtype), dim=-1)
    r, c = cand.nonzero(as_tuple=True)
    scored = torch.full_like(s, float("-inf"))
    scored[r, c] = s[r, c] + _gumbel(_finish(state[r], c), dtype)
    return torch.argmax(scored, dim=-1)


def sample_keyed(logits: torch.Tensor, temperature, top_k, top_p, seed: int, step: int, prompt_uid: torch.Tensor,
                 sample_idx: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Sampled tokens [N], bit for bit ``sample(logits, gumbel_noise(seed, step, prompt_uid,
    sample_idx, position, V, logits.dtype), temperature, top_k, top_p).tokens``, at a fraction
    of the cost: greedy rows (T=0) take no noise at all, and the other rows hash only the tokens
    that can still win the Gumbel argmax (the O(N * V) hash is most of a CPU decode step at a
    50k-150k vocabulary otherwise). Parameters are scalars or tensors [N]; the key tensors are [N].

    Why pruning is exact. Let ``s`` be a row of ``filter_logits`` (dtype d), ``m = max(s)`` and
    ``lo, hi`` = NOISE_LO, NOISE_HI rounded to d. Every noise value g satisfies lo <= d(g) <= hi
    (rounding to d is monotone, so the bounds survive the cast). Rounding of ``a + b`` is
    monotone in each argument, so for every token v: fl(s_v + g_v) <= fl(s_v + hi), and for the
    top token t (s_t = m): fl(m + lo) <= fl(s_t + g_t). A token with fl(s_v + hi) < fl(m + lo)
    therefore scores strictly below token t: it is never the argmax, not even in a tie. Tighter:
    the exact scores of the ``PROBE`` highest logits (t among them) have a best ``b`` >= fl(m +
    lo) that the row's argmax score reaches, so every token with fl(s_v + hi) < b scores strictly
    below the argmax. All other tokens ("candidates") get their exact noise and score, the rest
    -inf, and the argmax (lowest id on ties) is the same as over the full row. (On SmolLM2's
    logits at T=1: ~10k candidates of 49k per row with the m + lo bound, ~2.8k with b.) A row
    whose max is NaN (NaN logits) keeps every token, so NaN rows pick what the full computation
    picks too. On CPU the C++ kernel ``megarl._keyed_gumbel`` does the same in one pass per row
    (scoring the PROBE highest first, then tightening the bound as it goes; with AVX-512, 16
    tokens per instruction, the same float32 ops); calls with a NaN row take the torch path."""
    n = logits.shape[0]
    dev, dtype = logits.device, logits.dtype
    t = _as_col(temperature, n, dtype, dev)[:, 0]
    hot = t != 0
    if not bool(hot.any()):
        return torch.argmax(logits, dim=-1)  # greedy rows: the raw argmax, no noise
    rows = None if bool(hot.all()) else hot.nonzero()[:, 0]
    tokens = None if rows is None else torch.argmax(logits, dim=-1)
    pick = (lambda x, dt: _as_col(x, n, dt, dev)[:, 0]) if rows is None else (
        lambda x, dt: _as_col(x, n, dt, dev)[rows, 0])
    key = [x.to(dev, torch.int64) for x in (prompt_uid, sample_idx, position)]
    if rows is not None:
        logits, key = logits[rows], [x[rows] for x in key]
    s = filter_logits(logits, pick(temperature, dtype), pick(top_k, torch.int64), pick(top_p, torch.float64))
    hi = torch.tensor(NOISE_HI, dtype=dtype, device=dev)
    picked = None
    if _native_ok(s):
        # one fused pass per row: key, noise, pruning and argmax (same bits; csrc/keyed_gumbel.cpp)
        fn = _native.keyed_argmax_f32 if dtype == torch.float32 else _native.keyed_argmax_f64
        picked = torch.from_numpy(fn(s.contiguous().numpy(), seed & ((1 << 64) - 1), step & _M32,
                                     *[x.contiguous().numpy() for x in key], float(hi), torch.get_num_threads(),
                                     NATIVE_VECTOR))
        if bool((picked < 0).any()):  # a row with NaN (the kernel's -1): the call takes the torch path
            picked = None
    if picked is None:
        picked = _pruned_argmax(s, hi, _row_state(seed, step, *key))
    if rows is None:
        return picked
    return tokens.index_put((rows,), picked)


def token_stats(logits: torch.Tensor, temperature, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token) [N] and the entropy [N] of softmax(logits / T) per row (unfiltered; T=0 rows
    read as T=1), in at least fp32. ``temperature`` is a scalar or a tensor [N]."""
    n = logits.shape[0]
    stat_dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(stat_dtype)
    t = _effective_temperature(temperature, n, stat_dtype, logits.device)
    if not bool((t == 1).all()):  # T = 1 (and greedy) rows: no [N, V] pass for the division
        x = x / t
    # Six passes over [N, V] instead of ten (at a 49k vocabulary and 64 rows this was 4% of a
    # decode step): x - max, exp, sum, and H = log Z - sum_v p_v (x_v - max) as one batched dot.
    x = x - x.amax(dim=-1, keepdim=True)
    e = x.exp()
    z = e.sum(dim=-1)
    log_z = z.log()
    logprobs = x.gather(1, tokens[:, None])[:, 0] - log_z
    x.clamp_(min=torch.finfo(stat_dtype).min)  # a -inf logit (p = 0) must add 0 * finite, not nan
    entropies = log_z - torch.bmm(e[:, None, :], x[:, :, None])[:, 0, 0] / z
    return logprobs, entropies.clamp_(min=0.0)
