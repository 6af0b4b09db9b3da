"""Speculative verification (DESIGN.md §2): the target's own sample at every draft position.

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

from megarl.engine.sampler import gumbel_noise, sample

BACKENDS = ("auto", "torch", "triton")
TRITON_DTYPES = (torch.float32, torch.float64)


def _check(name: str, t, shape: tuple, kind: str, device) -> None:
    """Shape / dtype-kind / device check with an error that names the argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"verify: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"verify: {name} has shape {tuple(t.shape)}, expected {shape}")
    ok = t.dtype == torch.int64 if kind == "int64" else t.dtype.is_floating_point
    if not ok:
        raise TypeError(f"verify: {name} has dtype {t.dtype}, expected {kind}")
    if t.device != device:
        raise ValueError(f"verify: {name} is on {t.device}, expected the logits' device {device}")


def check_inputs(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0,
                 seed, step) -> None:
    """Validate shapes, dtypes, devices, the row grouping and the sampling parameters' ranges
    (one small device->host read)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("verify: logits must be a floating tensor [N, V]")
    n, v = logits.shape
    if n < 1 or v < 1:
        raise ValueError(f"verify: logits shape {tuple(logits.shape)} is empty")
    dev = logits.device
    if not isinstance(row_start, torch.Tensor) or row_start.dim() != 1 or row_start.numel() < 2:
        raise ValueError("verify: row_start must be an int64 tensor [B+1] with B >= 1")
    b = row_start.numel() - 1
    _check("row_start", row_start, (b + 1,), "int64", dev)
    _check("draft_next", draft_next, (n,), "int64", dev)
    for name, t, kind in [("temperature", temperature, "float"), ("top_k", top_k, "int64"),
                          ("top_p", top_p, "float"), ("uid", uid, "int64"),
                          ("sample_idx", sample_idx, "int64"), ("position0", position0, "int64")]:
        _check(name, t, (b,), kind, dev)
    for name, x in [("seed", seed), ("step", step)]:
        if not isinstance(x, int):
            raise TypeError(f"verify: {name} must be an int, got {type(x).__name__}")
    # one device->host read for every value check
    flags = torch.stack([~(temperature >= 0).all(), (top_k < 0).any(), ~((top_p > 0) & (top_p <= 1)).all()])
    *rs, bad_t, bad_k, bad_p = torch.cat([row_start, flags.to(torch.int64)]).tolist()
    if rs[0] != 0 or rs[-1] != n or any(hi <= lo for lo, hi in zip(rs, rs[1:])):
        raise ValueError(f"verify: row_start must rise strictly from 0 to N={n} (every request >= 1 row), "
                         f"got {rs if b <= 16 else rs[:8] + ['...'] + rs[-8:]}")
    for bad, msg in [(bad_t, "temperature must be >= 0 (0 = greedy)"), (bad_k, "top_k must be >= 0 (0 = off)"),
                     (bad_p, "top_p must lie in (0, 1] (1 = off)")]:
        if bad:
            raise ValueError(f"verify: {msg}")


def row_request(row_start: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, row index within the request) of every row [N] (no host sync)."""
    rows = torch.arange(n, device=row_start.device)
    req = torch.searchsorted(row_start, rows, right=True) - 1
    return req, rows - row_start[req]


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


def verify_torch(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0,
                 seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``sampler.gumbel_noise`` + ``sampler.sample`` over all rows at once."""
    n, v = logits.shape
    req, j = row_request(row_start, n)
    noise = gumbel_noise(seed, step, uid[req], sample_idx[req], position0[req] + j, v, logits.dtype)
    temp = temperature.to(logits.dtype)[req]
    tokens = sample(logits, noise, temp, top_k[req], top_p.to(torch.float64)[req]).tokens
    return tokens, accept_counts(tokens, draft_next, row_start)


def _triton_usable(logits: torch.Tensor) -> bool:
    if not logits.is_cuda or logits.dtype not in TRITON_DTYPES:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def verify(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0, seed: int, step: int,
           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32/float64, rows grouped by request: request b owns rows row_start[b]:row_start[b+1]
    (row_start [B+1] int64, every request >= 1 row). draft_next [N] int64: the draft token that row r's target
    sample must equal for verification to continue past row r; -1 on each request's last row (no draft there:
    bonus row). temperature/top_k/top_p/uid/sample_idx/position0: [B] per request (float / int64). Row j of
    request b samples with noise key (seed, step, uid[b], sample_idx[b], position0[b] + j).

    Returns tokens [N] int64 = the target's own sample at every row (exactly what sampler.sample gives for that
    row), and n_accept [B] int64 = number of leading rows j of request b with tokens[row] == draft_next[row]
    (stops at the first mismatch; the last row never matches). The engine emits
    tokens[row_start[b] : row_start[b] + n_accept[b] + 1].

    Temperature is taken in the logits' dtype and top_p in float64, as ``sampler.sample`` does.
    ``backend``: "torch", "triton" (float32/float64 logits), or "auto" (triton for float32/float64
    logits on CUDA when triton imports, else torch). All tensors live on the logits' device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"verify: backend={backend!r} is invalid; valid choices: {', '.join(BACKENDS)}")
    check_inputs(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0, seed, step)
    if backend == "auto":
        backend = "triton" if _triton_usable(logits) else "torch"
    if backend == "torch":
        return verify_torch(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0,
                            seed, step)
    from megarl.spec.verify_triton import verify_triton  # lazy: triton is optional on CPU
    return verify_triton(logits, draft_next, row_start, temperature, top_k, top_p, uid, sample_idx, position0,
                         seed, step, check=False)
