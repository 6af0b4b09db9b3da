"""Weight sync: the trainer's Megatron pieces -> the rollout engine's layout, in buckets (docs/design.md §2).

Colocated placement (``megarl/parallel/layout.py``): every process holds a trainer piece (its TP
rank, PP stage and, for MoE experts, EP rank) and a rollout engine (its rollout-TP slice). After
each optimizer step every rank calls :class:`WeightSync`; afterwards each engine holds exactly its
slice of the trainer's weights, which the sync proves with checksums.

The plan. Built once from ``ModelArgs`` and the layout sizes (:func:`megarl.models.mcore_sharding.local_plan`),
identical on every rank, so no names or shapes are ever sent: a fixed list of buckets, each a
group of tensors owned by one pipeline stage (dense tensors and MoE experts in separate buckets),
each bucket at most ``bucket_mb`` of communication buffer (a tensor whose buffer alone is larger
travels alone). For each bucket, in order, every rank:

1. ``pp`` hop: the owner stage packs its TP piece of every tensor of the bucket into one flat byte
   buffer (a *chunk*: the pieces at 16-byte aligned offsets, then a trailer) and broadcasts it
   over the PP group, so each rank of the other stages gets the chunk of its own TP (and EP) rank;
2. ``tp`` hop: one all_gather of the chunk over the trainer TP group (all stages at once);
3. ``ep`` hop (expert buckets): one all_gather over the EP group, which brings the other EP
   ranks' experts (global expert ``e*E/ep + j`` is EP rank ``e``'s local expert ``j``);
4. every rank joins each tensor's TP pieces into the full Megatron tensor (vocab padding stripped,
   :func:`~megarl.models.mcore_sharding.join_pieces`), converts it to HF names
   (:func:`~megarl.models.mcore_mapping.mcore_tensor_to_hf`) and copies this rollout-TP rank's
   slice (:func:`~megarl.engine.tp_model.tp_slice`) into its engine's parameters.

Disaggregated placement (trainer processes and generating-only processes apart): the trainers
run steps 1-3 among themselves; then a fourth hop, ``bridge``: trainer rank 0, which holds every
bucket's gathered chunks after those hops, broadcasts them over the bridge group (itself and the
generating processes), and each generating process checks the chunks' trailers and does step 4.
The trainers still join every tensor (for ``weight_checksum``) but load no engine. The bridge
sends the whole bucket to every generating process, rollout-TP slices included that it drops
(rollout TP times the bytes a slice-aware send would move; one bucket of memory either way).

Collectives of size-1 groups are skipped; where no hop is needed at all (TP=PP=1, and EP=1 or a
dense bucket) nothing is packed either: the trainer's parameters are the pieces, so the
single-process sync is a direct, checked copy through the same plan and code. Broadcasting the
pieces before gathering (rather than gathering on the owner stage, then broadcasting full
tensors) moves 1/tp of the bucket over the PP hop and lets every stage's TP group gather at once.

Memory. Buffers are allocated per bucket and dropped after it: the gathered chunks (at most
``bucket_mb``), this rank's own chunk (1/tp of that), and, one tensor at a time, the joined full
tensor and its HF conversion (the q/k/v of a fused qkv are copies). So the extra memory is about
one bucket plus one tensor; the whole model is never held. ``weight_sync_peak_bytes`` records the
largest single buffer or tensor a sync allocated.

Checks, every sync, with an exact integer :func:`byte_checksum` computed on the device (only
checksums, never buffers, are copied to the host):
- transport: the sender writes each piece's checksum into its chunk's trailer (after a header
  ``[bucket, sender rank, tp_rank, ep_rank]``); every receiver recomputes the checksums of the
  chunks it received, on every hop, and checks the header (a mis-ordered collective or a wrong
  layout shows up there);
- trainer consistency: replicated tensors (norms, routers) must be bitwise equal on all trainer
  TP ranks, and with tied embeddings and PP > 1 the last stage's copy of the embedding must equal
  stage 0's (compared by checksum, nothing extra is sent);
- engine: after the copy, each engine parameter's checksum must equal that of the slice (cast to
  the engine dtype) it should hold;
- the combined ``weight_checksum`` (sha256 over every full Megatron tensor's name, dtype, shape and
  checksum, in name order) must be equal on all ranks. Full tensors do not depend on the layout,
  so the value is the same for any TP/PP/EP and rollout TP with equal weights, and
  :func:`weight_checksum` computes it from a full HF state dict.
A rank records failures and finishes the sync (raising mid-sync would leave the other ranks
blocked in the next collective); then all ranks exchange them, and every rank raises the same
:class:`WeightSyncError` naming each failing bucket, tensor and rank.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from megarl.engine.tp_model import tp_slice
from megarl.parallel.checksum import byte_checksum, combine_checksums
from megarl.parallel.collectives import all_gather_single, group_device
from megarl.models import mcore_mapping, mcore_sharding
from megarl.models.config import ModelArgs
from megarl.parallel.buckets import HEADER, Bucket, BucketItem, numel, plan_buckets

DEFAULT_BUCKET_MB = 64.0
"""Default bucket size: large enough that a collective's latency is small against its transfer
on a cluster, small enough to be a negligible extra next to the model and the KV cache."""

class WeightSyncError(RuntimeError):
    """Weights were corrupted or lost on their way from the trainer to the engine."""


# ---------------------------------------------------------------------- one sync's bookkeeping


class _Received(NamedTuple):
    """A chunk this rank received: what its trailer must say, what it says, what arrived."""

    bucket: int
    hop: str
    chunk: int
    names: list[str]
    want: tuple[int, int, int | None]  # bucket, tp_rank, ep_rank (None: not checked)
    got: torch.Tensor  # recomputed piece checksums [3k]
    trailer: torch.Tensor  # header and the sender's checksums [4 + 3k]


class _Record:
    """What a sync checks, kept on the device until the end (one host copy per sync)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.transport: list[_Received] = []
        self.same: list[tuple[str, torch.Tensor]] = []  # (what must agree, [n, 3] checksums that must be equal)
        self.engine: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (bucket, HF name, got, expected)
        self.full: list[tuple[str, tuple[int, ...], torch.Tensor]] = []  # (name, full shape, checksum)
        self.peak = 0
        self.wire = 0

    def alloc(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)

    def errors(self, engine_rank: str) -> tuple[list[str], list[tuple]]:
        """Failure messages and the full-tensor (name, shape, checksum) list, on the host."""
        host = _to_host([*(t for r in self.transport for t in (r.got, r.trailer)),
                         *(r[1] for r in self.same), *(t for r in self.engine for t in (r[2], r[3])),
                         *(r[2] for r in self.full)])
        it = iter(host)
        out: list[str] = []
        me = f"rank {self.rank}"
        for r in self.transport:
            got, trailer, want = next(it).tolist(), next(it).tolist(), r.want
            head, sent = trailer[:HEADER], trailer[HEADER:]
            where = (f"{me}: bucket {r.bucket}, {r.hop} hop, chunk {r.chunk} (sent by rank {head[1]}, "
                     f"tp_rank {head[2]}, ep_rank {head[3]})")
            if [head[0], head[2], head[3] if want[2] is not None else None] != list(want):
                out.append(f"{where}: header says bucket {head[0]}, tp_rank {head[2]}, ep_rank {head[3]}; "
                           f"expected bucket {want[0]}, tp_rank {want[1]}"
                           + (f", ep_rank {want[2]}" if want[2] is not None else "")
                           + " (collectives out of order or a different layout)")
            bad = [name for i, name in enumerate(r.names) if got[3 * i:3 * i + 3] != sent[3 * i:3 * i + 3]]
            if bad:
                out.append(f"{where}: checksum mismatch in {', '.join(bad)} (received bytes differ from "
                           f"the bytes sent)")
        for what, _ in self.same:
            rows = next(it).view(-1, 3).tolist()
            if any(r != rows[0] for r in rows):
                out.append(f"{me}: {what} (checksums {rows}): the trainer pieces are not one model")
        for bucket, name, _, _ in self.engine:
            got, want = next(it).tolist(), next(it).tolist()
            if got != want:
                out.append(f"{me}: bucket {bucket}: engine tensor {name} ({engine_rank}) does not hold its "
                           f"slice after loading (checksum {got} != {want})")
        full = [(name, shape, next(it).tolist()) for name, shape, _ in self.full]
        return out, full


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Int64 device tensors -> host, in one copy."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    return list(flat.split([t.numel() for t in tensors]))


def _copy_to_engine(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a slice into an engine parameter (cast to its dtype and device). A module function so
    tests can replace it with a faulty copy and see the engine check catch it."""
    dst.copy_(src)


# ---------------------------------------------------------------------- the sync


class WeightSync:
    """Syncs a ``Trainer``'s weights into a rollout ``Engine``. Colocated: every rank of the
    default process group calls it with its own trainer piece and engine. Disaggregated: trainer
    ranks pass their trainer and ``engine=None``, generating-only ranks ``trainer=None``, their
    engine and ``receiver=(dims, args, dtype)`` (the trainer's layout sizes, model and dtype: the
    plan), and all pass the ``bridge`` group (trainer rank 0 and the generating ranks, see the
    module docstring). Create once per run, call after each optimizer step (every rank); returns
    metrics, raises :class:`WeightSyncError` on any failed check (module docstring).

    ``receive_hook(bucket_index, hop, buffer)``: test hook, called on every received buffer (hop
    ``pp``, ``tp``, ``ep`` or ``bridge``; the uint8 buffer of all chunks) before it is verified;
    tests flip a byte in it to prove a corrupted transfer is caught. None in normal runs."""

    def __init__(self, trainer, engine, bucket_mb: float = DEFAULT_BUCKET_MB, *,
                 bridge: dist.ProcessGroup | None = None, receiver: tuple | None = None):
        if not bucket_mb > 0:
            raise ValueError(f"weight sync bucket_mb={bucket_mb} is invalid; valid range: > 0")
        if (trainer is None) != (receiver is not None) or (engine is None and trainer is None):
            raise ValueError("weight sync: pass a trainer (a training rank), or engine and receiver=(dims, args, "
                             "dtype) (a generating-only rank)")
        if bridge is None and (trainer is None or engine is None):
            raise ValueError("weight sync: a rank that only trains or only generates needs the bridge group "
                             "(disaggregated placement)")
        self.trainer, self.engine, self.bridge = trainer, engine, bridge
        if trainer is not None:
            self.args: ModelArgs = trainer.args
            self.dims = d = trainer.dims
            self.dtype: torch.dtype = trainer.dtype
        else:
            self.dims, self.args, self.dtype = receiver
            d = self.dims
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        # With virtual pipeline stages the buckets go stage by stage over pp * vpp stages; stage s is
        # owned by pipeline rank s % pp (mcore_sharding's docstring).
        self.buckets = plan_buckets(self.args, d.tp, d.stages, d.ep, self.dtype, self.bucket_bytes)
        self.hf_names = mcore_mapping.mcore_to_hf_names(self.args)
        esize = torch.empty((), dtype=self.dtype).element_size()
        # bytes of the full tensors a sync delivers: the whole model, once (weight_sync_bytes)
        self.total_bytes = sum(esize * numel(it.full_shape) * len(it.names) for b in self.buckets for it in b.items)
        self.receive_hook = None
        # Tied embeddings with PP > 1: the last stage's output layer is a copy of stage 0's
        # embedding (mcore_sharding), checked against the embedding piece it receives.
        self._tied = next(((b.index, i) for b in self.buckets for i, it in enumerate(b.items)
                           if it.local == "embedding.word_embeddings.weight"), None)
        if not (trainer is not None and self.args.tie_word_embeddings and d.pp > 1 and d.pp_rank == d.pp - 1):
            self._tied = None  # only the rank holding the last stage keeps the copy
        if trainer is not None:
            self._check_trainer()
        if engine is not None:
            self._check_engine()

    # ------------------------------------------------------------------ setup checks

    def _check_trainer(self) -> None:
        """This rank's GPTModel piece holds exactly the plan's tensors (names, shapes, dtype)."""
        d = self.dims
        for stage, local in self.trainer.local_pieces().items():
            plan = mcore_sharding.local_plan(self.args, d.tp, d.stages, stage, ep=d.ep, ep_rank=d.ep_rank)
            bad = sorted(set(plan) ^ set(local))
            bad += [f"{k}: {tuple(local[k].shape)} {local[k].dtype}, expected {plan[k].shape} {self.dtype}"
                    for k in sorted(set(plan) & set(local))
                    if tuple(local[k].shape) != plan[k].shape or local[k].dtype != self.dtype]
            if bad:
                raise ValueError(f"weight sync: the trainer piece of rank {d.rank} (tp_rank {d.tp_rank}, pp_rank "
                                 f"{d.pp_rank}, stage {stage}, ep_rank {d.ep_rank}) does not match the plan: "
                                 f"{bad[:8]}")

    def _check_engine(self) -> None:
        """The engine holds exactly the HF tensors the plan delivers, at this rollout rank's shapes."""
        e = self.engine
        params = e.model.state_dict()
        expected: dict[str, tuple[int, ...]] = {}
        for b in self.buckets:
            for it in b.items:
                for name in it.names:
                    meta = torch.empty(it.full_shape, dtype=self.dtype, device="meta")
                    for hf, t in mcore_mapping.mcore_tensor_to_hf(name, meta, self.args, self.hf_names[name]).items():
                        expected[hf] = tuple((tp_slice(hf, t, e.tp_rank, e.tp_size) if e.tp_size > 1 else t).shape)
        bad = [f"missing in engine: {k}" for k in sorted(set(expected) - set(params))]
        bad += [f"not sent by the trainer: {k}" for k in sorted(set(params) - set(expected))]
        bad += [f"{k}: engine {tuple(params[k].shape)}, slice {s}" for k, s in expected.items()
                if k in params and tuple(params[k].shape) != s]
        if bad:
            raise ValueError(f"weight sync: the engine (rollout tp_rank {e.tp_rank} of {e.tp_size}) does not "
                             f"match the trainer's model: {bad[:8]}")

    # ------------------------------------------------------------------ one sync

    @torch.no_grad()
    def __call__(self) -> dict[str, float | str]:
        """Move the trainer's current weights into the engine; return ``weight_sync_s``,
        ``weight_sync_bytes`` (bytes of the full tensors delivered), ``weight_sync_gbps``
        (their GB/s), ``weight_checksum`` (16 hex digits, layout-independent),
        ``weight_sync_buckets``, ``weight_sync_peak_bytes`` (largest buffer or tensor allocated)
        and ``weight_sync_wire_bytes`` (bytes this rank received over collectives)."""
        t0 = time.perf_counter()
        d = self.dims
        rec = _Record(d.rank)
        local = self.trainer.local_pieces() if self.trainer is not None else {}  # stage -> this rank's piece
        engine_sd = self.engine.model.state_dict() if self.engine is not None else None
        for b in self.buckets:
            chunks, buf = self._transport(b, local, rec) if self.trainer is not None else (None, None)
            if self.bridge is not None:
                chunks, buf = self._bridge(b, chunks, buf, local, rec)
            self._deliver(b, chunks, buf, engine_sd, rec)
            del chunks, buf  # the bucket's buffers go before the next bucket's are allocated
        e = self.engine
        errors, full = rec.errors(f"rollout tp_rank {e.tp_rank} of {e.tp_size}" if e is not None else "no engine")
        digest = combine_checksums([(name, str(self.dtype), shape, cs) for name, shape, cs in full])
        self._agree(errors, digest)
        dt = time.perf_counter() - t0
        return {"weight_sync_s": dt, "weight_sync_bytes": float(self.total_bytes),
                "weight_sync_gbps": self.total_bytes / max(dt, 1e-9) / 1e9, "weight_checksum": digest[:16],
                "weight_sync_buckets": float(len(self.buckets)), "weight_sync_peak_bytes": float(rec.peak),
                "weight_sync_wire_bytes": float(rec.wire)}

    def _moves(self, b: Bucket) -> bool:
        """Whether bucket ``b`` needs any hop (otherwise the local parameters are its pieces)."""
        d = self.dims
        return d.tp > 1 or d.pp > 1 or (b.expert and d.ep > 1)

    def _view(self, buf: torch.Tensor, chunk: int, b: Bucket, it: BucketItem) -> torch.Tensor:
        start = chunk * b.chunk + it.offset
        return buf[start:start + it.nbytes].view(self.dtype).view(it.shape)

    def _trailer(self, buf: torch.Tensor, chunk: int, b: Bucket) -> torch.Tensor:
        start = chunk * b.chunk + b.payload
        return buf[start:start + 8 * (HEADER + 3 * len(b.items))].view(torch.int64)

    def _pack(self, b: Bucket, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """(``local``: this rank's piece of stage ``b.stage``.)"""
        """This rank's chunk of ``b``: its pieces, then the header and their checksums."""
        d = self.dims
        buf = torch.empty(b.chunk, dtype=torch.uint8, device=d.device)
        sums = []
        for it in b.items:
            view = self._view(buf, 0, b, it)
            view.copy_(local[it.local])
            sums.append(byte_checksum(view))
        trailer = self._trailer(buf, 0, b)
        trailer[:HEADER] = torch.tensor([b.index, d.rank, d.tp_rank, d.ep_rank], dtype=torch.int64)
        trailer[HEADER:] = torch.stack(sums).reshape(-1)
        return buf

    def _transport(self, b: Bucket, local: dict[int, dict[str, torch.Tensor]], rec: _Record):
        """The pieces of ``b`` on this rank after every hop: per chunk (EP-major, then TP rank) the
        list of piece views, and the buffer holding them (None without hops). ``local``: this
        rank's pieces by stage."""
        d = self.dims
        if not self._moves(b):
            return [[local[b.stage][it.local] for it in b.items]], None
        owner = b.stage in local
        buf = self._pack(b, local[b.stage]) if owner else torch.empty(b.chunk, dtype=torch.uint8, device=d.device)
        rec.alloc(b.chunk)
        if d.pp > 1:
            dist.broadcast(buf, group=d.pp_group, group_src=b.stage % d.pp)
            if not owner:
                rec.wire += b.chunk
                self._received(b, "pp", buf, [0], lambda c: (d.tp_rank, d.ep_rank), rec)
                if self._tied is not None and self._tied[0] == b.index:
                    i = self._tied[1]
                    rows = torch.stack([self._trailer(buf, 0, b)[HEADER + 3 * i:HEADER + 3 * i + 3],
                                        byte_checksum(local[d.stages - 1]["output_layer.weight"])])
                    rec.same.append((f"bucket {b.index}: tied embeddings: the last stage's copy "
                                     f"(output_layer.weight, tp_rank {d.tp_rank}) differs from stage 0's "
                                     f"embedding.word_embeddings.weight", rows))
        for hop, size, group, rank in (("tp", d.tp, d.tp_group, d.tp_rank),
                                       ("ep", d.ep if b.expert else 1, d.ep_group, d.ep_rank)):
            if size == 1:
                continue
            per = buf.numel() // b.chunk  # chunks each rank contributes
            out = torch.empty(buf.numel() * size, dtype=torch.uint8, device=d.device)
            all_gather_single(out, buf, group=group)
            buf = out
            rec.alloc(buf.numel())
            rec.wire += buf.numel() - buf.numel() // size
            mine = range(rank * per, (rank + 1) * per)
            others = [c for c in range(per * size) if c not in mine]
            if hop == "tp":
                self._received(b, hop, buf, others, lambda c: (c, d.ep_rank), rec)
            else:
                self._received(b, hop, buf, others, lambda c: (c % d.tp, c // d.tp), rec)
        n = buf.numel() // b.chunk
        return [[self._view(buf, c, b, it) for it in b.items] for c in range(n)], buf

    def _bridge(self, b: Bucket, chunks, buf, local: dict[int, dict[str, torch.Tensor]], rec: _Record):
        """Disaggregated hop: trainer rank 0 broadcasts the bucket's gathered chunks (packing its
        own pieces first when no trainer hop did) to the generating ranks, which check them; the
        other trainers take no part. Returns (chunks, buffer) as :meth:`_transport` does."""
        d = self.dims
        if self.trainer is not None:
            if d.rank == 0:
                out = buf if buf is not None else self._pack(b, local[b.stage])
                dist.broadcast(out, group=self.bridge, group_src=0)
            return chunks, buf
        buf = torch.empty(b.gathered, dtype=torch.uint8, device=d.device)
        rec.alloc(b.gathered)
        dist.broadcast(buf, group=self.bridge, group_src=0)
        rec.wire += b.gathered
        n = b.gathered // b.chunk  # chunks: EP-major, then TP rank (as the trainer's hops leave them)
        self._received(b, "bridge", buf, list(range(n)), lambda c: (c % d.tp, c // d.tp), rec)
        return [[self._view(buf, c, b, it) for it in b.items] for c in range(n)], buf

    def _received(self, b: Bucket, hop: str, buf: torch.Tensor, chunks: list[int], who, rec: _Record) -> None:
        """Record the checks of the ``chunks`` of ``buf`` that came from other ranks; ``who(c)``
        gives the (tp_rank, ep_rank) chunk ``c`` must come from."""
        if self.receive_hook is not None:
            self.receive_hook(b.index, hop, buf)
        for c in chunks:
            tp_rank, ep_rank = who(c)
            got = torch.stack([byte_checksum(self._view(buf, c, b, it)) for it in b.items]).reshape(-1)
            labels = [it.names[ep_rank if b.expert else 0] for it in b.items]
            want = (b.index, tp_rank, ep_rank if b.expert else None)
            rec.transport.append(_Received(b.index, hop, c, labels, want, got, self._trailer(buf, c, b).clone()))

    def _deliver(self, b: Bucket, chunks: list[list[torch.Tensor]], buf: torch.Tensor | None,
                 engine_sd: dict[str, torch.Tensor], rec: _Record) -> None:
        """Join, convert and load every tensor of ``b`` into the engine (if this rank has one),
        recording the checks."""
        tp = self.dims.tp if buf is not None else 1
        e_rank, e_size = (self.engine.tp_rank, self.engine.tp_size) if engine_sd is not None else (0, 1)
        for e in range(len(chunks) // tp):
            for i, it in enumerate(b.items):
                pieces = [chunks[e * tp + t][i] for t in range(tp)]
                if it.kind == "replicated" and tp > 1 and e == 0:
                    rows = torch.stack([self._trailer(buf, c, b)[HEADER + 3 * i:HEADER + 3 * i + 3]
                                        for c in range(tp)])
                    rec.same.append((f"bucket {b.index}: replicated tensor {it.names[0]} differs between trainer "
                                     f"TP ranks", rows))
                full = mcore_sharding.join_pieces(pieces, it.kind, it.full_shape)
                if full.data_ptr() != pieces[0].data_ptr():
                    rec.alloc(full.numel() * full.element_size())
                name = it.names[e]
                full_sum = byte_checksum(full)
                rec.full.append((name, it.full_shape, full_sum))
                if engine_sd is None:  # a trainer-only rank: the checksum is all it needs
                    continue
                hf = mcore_mapping.mcore_tensor_to_hf(name, full, self.args, self.hf_names[name])
                if len(hf) == 3:  # q/k/v are copies
                    rec.alloc(full.numel() * full.element_size())
                for hf_name, t in hf.items():
                    dst = engine_sd[hf_name]
                    src = tp_slice(hf_name, t, e_rank, e_size) if e_size > 1 else t
                    _copy_to_engine(dst, src)
                    expected = src.to(device=dst.device, dtype=dst.dtype)
                    if expected is full:  # renamed whole, same dtype: its checksum is known
                        want = full_sum
                    else:
                        if expected is not src:
                            rec.alloc(expected.numel() * expected.element_size())
                        want = byte_checksum(expected)
                    rec.engine.append((b.index, hf_name, byte_checksum(dst), want))

    def _agree(self, errors: list[str], digest: str) -> None:
        """Every rank raises the same error if any rank failed a check or holds other weights."""
        d = self.dims
        if d.world_size == 1:
            if errors:
                raise WeightSyncError("weight sync failed:\n" + "\n".join(errors))
            return
        words = [int.from_bytes(bytes.fromhex(digest)[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
        mine = torch.tensor([len(errors), *words], dtype=torch.int64, device=group_device())
        every = torch.empty(d.world_size * mine.numel(), dtype=torch.int64, device=mine.device)
        all_gather_single(every, mine)
        every = every.view(d.world_size, -1).cpu()
        if int(every[:, 0].sum()):
            lists: list = [None] * d.world_size
            dist.all_gather_object(lists, errors)
            raise WeightSyncError("weight sync failed:\n" + "\n".join(m for lst in lists for m in lst))
        groups: dict[tuple, list[int]] = {}
        for r in range(d.world_size):
            groups.setdefault(tuple(every[r, 1:].tolist()), []).append(r)
        if len(groups) > 1:
            raise WeightSyncError(f"weight sync: ranks hold different weights after the sync (ranks with equal "
                                  f"weight checksums: {sorted(groups.values())}): the trainer's data-parallel "
                                  f"replicas have diverged")

