"""Weight sync (megarl.parallel.weight_sync): the device checksum (exact, catches flipped and
swapped bytes), the bucket plan, the per-tensor sharding helpers it relies on, and on 4 gloo
processes (weight_sync_worker.py, one launch) trainer TP2 / PP2 / TP2xPP2 / EP2 / PP2xEP2 into
rollout TP1 and TP2: every engine holds its exact slice after every sync, the checksum is the same
on every rank and in every layout, corruption anywhere is caught and named."""
from pathlib import Path

import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.models.init_weights import init_hf_state
from megarl.parallel.checksum import MODULUS, byte_checksum, weight_checksum
from megarl.parallel.buckets import plan_buckets
from tests.conftest import tiny_args
from tests.torchrun import torchrun

from .weight_sync_worker import BUCKET_MB, DENSE, DISAGG, LAYOUTS, MOE, SEED, WORLD, case_args


def reference_checksum(t: torch.Tensor) -> list[int]:
    """``byte_checksum`` in plain int64 arithmetic on the host (no int32 partial sums, no blocks)."""
    half = 1 if t.element_size() == 1 else 2  # bytes per integer value
    cols = t.shape[-1] * t.element_size() // half if t.dim() else t.element_size() // half
    x = t.reshape(-1).contiguous().view(torch.uint8 if half == 1 else torch.int16).long().reshape(-1, cols)
    rows, cols = x.sum(1), x.sum(0)
    wr, wc = torch.arange(1, rows.numel() + 1), torch.arange(1, cols.numel() + 1)
    return [int(rows.sum()), int(((rows % MODULUS) * wr % MODULUS).sum()), int(((cols % MODULUS) * wc % MODULUS).sum())]


# ------------------------------------------------------------------ checksum


@pytest.mark.parametrize("shape,dtype", [((7, 5), torch.float32), ((13,), torch.float64), ((3, 4, 6), torch.bfloat16),
                                         ((9, 2), torch.int8), ((), torch.float32), ((0, 4), torch.float32)])
def test_checksum_is_exact(shape, dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    assert byte_checksum(t).tolist() == reference_checksum(t)


def test_checksum_block_path_equals_direct():
    """Tensors over 2^22 int16 values or 2^16 columns are summed in blocks: same exact value."""
    g = torch.Generator().manual_seed(1)
    for shape in [(2100, 1100), (70_000,), (3, 40_000)]:  # 4.6M values; 140k columns; 80k columns
        t = torch.randn(shape, generator=g) * 1e4
        assert byte_checksum(t).tolist() == reference_checksum(t), shape


def test_checksum_sees_flips_and_swaps():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(6, 10, generator=g)
    base = byte_checksum(t).tolist()
    for i, j in [((0, 1), (0, 7)), ((0, 3), (4, 3)), ((1, 2), (5, 9))]:  # same row, same column, neither
        s = t.clone()
        s[i], s[j] = t[j], t[i]
        assert byte_checksum(s).tolist() != base, (i, j)
    raw = t.clone().view(torch.uint8).view(-1)
    for k in range(0, raw.numel(), 37):  # any single bit flip
        flipped = raw.clone()
        flipped[k] ^= 1 << (k % 8)
        assert byte_checksum(flipped.view(torch.float32).view(6, 10)).tolist() != base, k
    swapped = raw.clone()  # the two bytes of one int16 half swapped
    swapped[[4, 5]] = raw[[5, 4]]
    assert raw[4] != raw[5] and byte_checksum(swapped.view(torch.float32).view(6, 10)).tolist() != base


def test_checksum_ignores_strides():
    """A row-parallel slice (non-contiguous view) has the checksum of its contiguous copy."""
    t = torch.randn(8, 12, dtype=torch.float64)
    view = t[:, 4:8]
    assert not view.is_contiguous() and torch.equal(byte_checksum(view), byte_checksum(view.contiguous()))


def test_weight_checksum_is_per_weights():
    args = tiny_args("qwen2")
    hf = init_hf_state(args, 0)
    assert weight_checksum(hf, args) == weight_checksum({k: v.clone() for k, v in hf.items()}, args)
    other = dict(hf)
    other["model.norm.weight"] = hf["model.norm.weight"].clone()
    other["model.norm.weight"][3] += 1e-6
    assert weight_checksum(other, args) != weight_checksum(hf, args)
    assert weight_checksum({k: v.double() for k, v in hf.items()}, args) != weight_checksum(hf, args)


# ------------------------------------------------------------------ plan and sharding helpers


@pytest.mark.parametrize("case,tp,pp,ep", [(("qwen2", False), 2, 2, 1), (("llama", True), 2, 2, 1),
                                          (("llama", True), 1, 1, 1), (("qwen3_moe", False), 1, 2, 2)])
def test_local_plan_and_join_rebuild_every_tensor(case, tp, pp, ep):
    args = case_args(*case)
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in mm.mcore_shapes(args).items()}
    seen = set()
    for p in range(pp):
        for e in range(ep):
            plan = ms.local_plan(args, tp, pp, p, ep=ep, ep_rank=e)
            pieces = [ms.shard_rank(full, args, tp, pp, t, p, ep=ep, ep_rank=e) for t in range(tp)]
            assert list(plan) == list(pieces[0])
            for local, lt in plan.items():
                assert all(tuple(pc[local].shape) == lt.shape for pc in pieces)
                joined = ms.join_pieces([pc[local] for pc in pieces], lt.kind, lt.full_shape)
                assert torch.equal(joined, full[lt.name]), (local, lt.name)
                out = torch.empty(lt.full_shape, dtype=torch.float64)
                assert torch.equal(ms.join_pieces([pc[local] for pc in pieces], lt.kind, lt.full_shape, out=out),
                                   full[lt.name])
                assert lt.tied_copy == (local == "output_layer.weight" and args.tie_word_embeddings)
                seen.add(lt.name)
    assert seen == set(full)


def test_mcore_tensor_to_hf_matches_mcore_to_hf():
    for args in (case_args("qwen2", False), case_args("llama", True), case_args("qwen3_moe", False)):
        hf = init_hf_state(args, 1, torch.float64)
        full = mm.hf_to_mcore(hf, args)
        names = mm.mcore_to_hf_names(args)
        assert set(names) == set(full)
        got = {}
        for name, t in full.items():
            got.update(mm.mcore_tensor_to_hf(name, t, args, names[name]))
        assert got.keys() == hf.keys() and all(torch.equal(got[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp,pp,ep,case", [(2, 2, 1, ("qwen2", False)), (1, 2, 2, ("qwen3_moe", False)),
                                          (2, 1, 1, ("llama", True))])
def test_buckets_cover_every_tensor_once_within_the_limit(tp, pp, ep, case):
    args = case_args(*case)
    limit = int(BUCKET_MB * 2 ** 20)
    buckets = plan_buckets(args, tp, pp, ep, torch.float64, limit)
    names = [n for b in buckets for it in b.items for n in it.names]
    assert sorted(names) == sorted(mm.mcore_shapes(args)) and len(buckets) >= 4
    for i, b in enumerate(buckets):
        assert b.index == i and b.gathered == b.chunk * tp * (ep if b.expert else 1) <= limit
        assert all(it.offset % 16 == 0 and it.offset + it.nbytes <= b.payload for it in b.items)
        assert all(x.offset + x.nbytes <= y.offset for x, y in zip(b.items, b.items[1:]))
        assert all((ep if b.expert else 1) == len(it.names) for it in b.items)
    assert [b.stage for b in buckets] == sorted(b.stage for b in buckets)  # stage by stage
    tiny = plan_buckets(args, tp, pp, ep, torch.float64, 1)  # each tensor travels alone
    assert all(len(b.items) == 1 for b in tiny) and len(tiny) == sum(len(b.items) for b in buckets)


# ------------------------------------------------------------------ multi-process


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's results of weight_sync_worker.py (one 4-process launch, every layout); the
    worker itself asserts the engines' contents and the error cases."""
    out = tmp_path_factory.mktemp("weight_sync")
    torchrun(Path(__file__).with_name("weight_sync_worker.py"), WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.multiproc
def test_checksum_equal_on_every_rank_and_layout(runs):
    for case in DENSE + MOE:
        args = case_args(*case)
        hf0 = init_hf_state(args, SEED, torch.float64)
        want = weight_checksum(hf0, args)  # what a single process with these weights reports
        layouts = [lay for lay in LAYOUTS if (lay[2] > 1) == (case in MOE)]
        for layout in layouts:
            per_rank = [r[layout][case] for r in runs]
            assert {r["checksum0"] for r in per_rank} == {want}
            assert all(m["weight_checksum"] == want for r in per_rank for m in r["metrics"].values())
            # after a training step every rank of the layout agrees on the new weights
            assert len({r["checksum1"] for r in per_rank}) == 1 and per_rank[0]["checksum1"] != want


@pytest.mark.multiproc
def test_metrics(runs):
    for layout, rollout_tps in LAYOUTS.items():
        for case in (MOE if layout[2] > 1 else DENSE):
            args = case_args(*case)
            model_bytes = sum(t.numel() * 8 for t in init_hf_state(args, SEED, torch.float64).values())
            for r in runs:
                assert sorted(r[layout][case]["metrics"]) == sorted(rollout_tps)
                for m in r[layout][case]["metrics"].values():
                    assert m["weight_sync_bytes"] == model_bytes
                    assert 0 < m["weight_sync_peak_bytes"] <= BUCKET_MB * 2 ** 20
                    assert m["weight_sync_buckets"] >= 4 and m["weight_sync_gbps"] > 0
                    assert 0 < m["weight_sync_wire_bytes"] < 2 * model_bytes


@pytest.mark.multiproc
def test_disaggregated_sync_reaches_the_generating_ranks(runs):
    """Trainers on some ranks, engines on the others (the bridge hop): every rank of a layout
    reports the checksum of the full weights, before and after a training step (the worker also
    checks every engine tensor bitwise and a corrupted bridge buffer)."""
    for layout in DISAGG:
        trainers, ep = layout[0], layout[3]
        for case in (MOE if ep > 1 else DENSE):
            args = case_args(*case)
            want = weight_checksum(init_hf_state(args, SEED, torch.float64), args)
            per_rank = [r[("disagg", *layout)][case] for r in runs]
            assert {r["checksum0"] for r in per_rank} == {want}, (layout, case)
            assert len({r["checksum1"] for r in per_rank}) == 1 and per_rank[0]["checksum1"] != want
            # what a generating rank received: the whole model once, plus chunk trailers and alignment
            model_bytes = sum(t.numel() * 8 for t in init_hf_state(args, SEED, torch.float64).values())
            for r in per_rank[trainers:]:
                assert model_bytes <= r["metrics"]["weight_sync_wire_bytes"] < 1.5 * model_bytes, (layout, case)
