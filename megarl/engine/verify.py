"""Speculative verification (docs/design.md §1): the target's own sample at every draft position.

Verification is a comparison, not a probability test: the target runs on the draft, the
counter-based sampler gives the target's token at each row with the row's own noise key, and
the draft is accepted up to the first row where the two differ. The emitted tokens are
therefore exactly the non-speculative ones.

Two backends with bitwise-identical results: ``torch`` (this module, built on
``megarl.engine.sampler``) and ``triton`` (``verify_triton.py``: one fused kernel, no [N, V]
noise tensor). The sampler's math is canonical (``megarl/engine/detmath.py``) so that the two
agree bit for bit, on CPU and on GPU.
"""
from __future__ import annotations

import torch

from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.verify_contract import TRITON_DTYPES, check_inputs, row_request

BACKENDS = ("auto", "torch", "triton")
def accept_counts(tokens: torch.Tensor, draft_next: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """n_accept [B]: leading rows of each request whose target token equals the draft.

    A request's last row never counts (it has no draft), whatever draft_next holds there."""
    n = tokens.numel()
    req, j = row_request(row_start, n)
    last = j == (row_start[1:] - row_start[:-1] - 1)[req]
    bad = (tokens != draft_next) | last
    # a row is accepted iff no mismatch at or before it in its request: exact integer prefix
    # sums (deterministic on every backend), differenced at the request boundaries
    bad_before = torch.cumsum(bad.to(torch.int64), 0) - bad.to(torch.int64)
    clean = (bad_before == bad_before[row_start[:-1]][req]) & ~bad
    csum = torch.cat([torch.zeros(1, dtype=torch.int64, device=tokens.device), torch.cumsum(clean.to(torch.int64), 0)])
    return csum[row_start[1:]] - csum[row_start[:-1]]


def verify_torch(logits, draft_next, row_start, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the tokens of ``sampler.gumbel_noise`` + ``sampler.sample`` over all rows at
    once, computed by ``sampler.sample_keyed`` (bit for bit the same tokens; the noise of greedy
    rows and of tokens that cannot win is never computed)."""
    req, j = row_request(row_start, logits.shape[0])
    tokens = rows.take(req).shifted(j).sample(logits)
    return tokens, accept_counts(tokens, draft_next, row_start)


def sample_rows(logits, rows: SamplingRows) -> torch.Tensor:
    """``verify``'s tokens when every request has exactly one row and no draft (plain decoding):
    the same sampling ``verify_torch`` does for such a batch (request b's row has the key position
    ``rows.position[b]``), without the input checks, row grouping and accept counts that only
    drafts need (~40 small tensor ops per step). Inputs are the caller's to check."""
    return rows.sample(logits)


def _triton_usable(logits: torch.Tensor) -> bool:
    if not logits.is_cuda or logits.dtype not in TRITON_DTYPES:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def verify(logits, draft_next, row_start, rows: SamplingRows,
           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32/float64, rows grouped by request: request b owns rows row_start[b]:row_start[b+1]
    (row_start [B+1] int64, every request >= 1 row). draft_next [N] int64: the draft token that row r's target
    sample must equal for verification to continue past row r; -1 on each request's last row (no draft there:
    bonus row). ``rows``: the B requests' sampling set-up (megarl/engine/sampling_rows.py). Row j of request b
    samples with noise key (seed, step, uid[b], sample_idx[b], position[b] + j).

    Returns tokens [N] int64 = the target's own sample at every row (exactly what sampler.sample gives for that
    row), and n_accept [B] int64 = number of leading rows j of request b with tokens[row] == draft_next[row]
    (stops at the first mismatch; the last row never matches). The engine emits
    tokens[row_start[b] : row_start[b] + n_accept[b] + 1].

    Temperature is taken in the logits' dtype, as ``sampler.sample`` does.
    ``backend``: "torch", "triton" (float32/float64 logits), or "auto" (triton for float32/float64
    logits on CUDA when triton imports, else torch). All tensors live on the logits' device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"verify: backend={backend!r} is invalid; valid choices: {', '.join(BACKENDS)}")
    check_inputs(logits, draft_next, row_start, rows)
    if backend == "auto":
        backend = "triton" if _triton_usable(logits) else "torch"
    if backend == "torch":
        return verify_torch(logits, draft_next, row_start, rows)
    from megarl.engine.verify_triton import verify_triton  # lazy: triton is optional on CPU
    return verify_triton(logits, draft_next, row_start, rows, check=False)
