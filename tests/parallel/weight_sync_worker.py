"""Worker for test_weight_sync.py, run under torchrun on 4 gloo processes with argv = (out_dir,).
Asserts itself (a failure exits non-zero and the test shows the output) and saves, per layout and
case, the checksums and metrics to ``out_dir/rank<r>.pt`` for the cross-layout checks.

One launch covers every layout of ``LAYOUTS`` (starting processes and importing Megatron costs
more than the tiny models): for each, every rank builds a fp64 ``Trainer`` piece from the seeded
full weights and engines of each rollout TP (TP=2: the rollout groups [0, 1] and [2, 3]), then
1. syncs: every engine parameter is bitwise its slice of the full weights (a float32 engine: of
   the weights cast), the checksum is ``weight_checksum`` of the full weights, on every rank;
   several buckets, none larger than ``BUCKET_MB``;
2. trains one step and syncs again: the engines hold the new weights (``Trainer.hf_state_dict``),
   the checksum follows them;
3. corrupts one byte of one received buffer on one rank (each hop the layout has): every rank
   raises ``WeightSyncError`` naming that rank, bucket, hop and tensor; a faulty engine copy on
   one rank: the same, naming the engine tensor; with tied embeddings and PP=2, a last-stage copy
   that differs from the embedding: the same; a clean sync then succeeds again.

Then the disaggregated layouts of ``DISAGG`` (the first ranks train, the others only generate;
the bridge hop from trainer rank 0): the same checks 1-2 on the generating ranks' engines, every
rank reporting the same checksum, and a corrupted bridge buffer named by the rank that got it.
"""
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

if __package__:  # imported by test_weight_sync.py (pytest)
    from tests.conftest import tiny_args
else:  # run by torchrun as a script
    warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.conftest import tiny_args

from megarl.engine import Engine, EngineConfig
from megarl.engine.tp_model import TPCausalLM, tp_shard
from megarl.models.init_weights import init_hf_state
from megarl.models.llama import CausalLM
from megarl.parallel import weight_sync
from megarl.parallel.dist import init_parallel, teardown
from megarl.parallel.layout import Layout, ParallelConfig, create_rollout_groups
from megarl.parallel.checksum import weight_checksum
from megarl.parallel.weight_sync import WeightSync, WeightSyncError
from megarl.trainer.trainer import Trainer, TrainerConfig

WORLD = 4
# (trainer tp, pp, ep) -> rollout TPs synced into
LAYOUTS = {(2, 1, 1): (1, 2), (1, 2, 1): (1, 2), (2, 2, 1): (1, 2), (1, 1, 2): (1,), (1, 2, 2): (1,)}
# Qwen2: qkv bias, untied; Llama: tied embeddings (with PP=2 the last stage keeps a copy).
DENSE = [("qwen2", False), ("llama", True)]
MOE = [("qwen3_moe", False)]
SEED = 3
# Disaggregated: (trainer processes, trainer tp, pp, ep, rollout tp); the rest of the 4 ranks generate.
# 2 x TP=2 -> one TP=2 engine; PP=2 (tied embeddings: the last stage's copy) -> 2 engines; 3 trainers
# without a model-parallel hop (rank 0 packs its own pieces) -> 1 engine; MoE EP=2 -> 2 engines.
DISAGG = [(2, 2, 1, 1, 2), (2, 1, 2, 1, 1), (3, 1, 1, 1, 1), (2, 1, 1, 2, 1)]
# Larger than the biggest tensor's gathered buffer (TP=2 vocab pieces: 2 x 128 x 32 fp64 = 64 KiB),
# small enough for several buckets per stage.
BUCKET_MB = 80 / 1024


def case_args(model_type: str, tie: bool):
    """4 layers (2 per stage with PP=2), vocab 200 (padded to 256 with TP=2: both vocab pieces
    hold real rows); the MoE: 4 experts of width 24, top-2, q/k norms."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24) if model_type == "qwen3_moe" else {}
    return tiny_args(model_type, tie=tie, num_hidden_layers=4, vocab_size=200, **moe)


def engine_dtype(case, rollout_tp: int) -> str:
    """One float32 engine (casts on the way in), the others float64 like the trainer."""
    return "float32" if case == ("llama", True) and rollout_tp == 1 else "float64"


def make_engine(args, rollout_tp: int, group, dtype: str) -> Engine:
    model = CausalLM(args) if rollout_tp == 1 else TPCausalLM(args, group)
    return Engine(model, EngineConfig(max_batch_size=2, max_seq_len=16, dtype=dtype), seed=0)


def assert_engine_holds(engine: Engine, hf: dict, where: str) -> None:
    """Every engine parameter is bitwise its rollout rank's slice of ``hf`` (cast to its dtype)."""
    want = tp_shard(hf, engine.tp_rank, engine.tp_size) if engine.tp_size > 1 else hf
    params = engine.model.state_dict()
    assert set(params) == set(want) - ({"lm_head.weight"} if engine.model.args.tie_word_embeddings else set())
    for name, p in params.items():
        w = want[name].to(p.dtype)
        assert p.shape == w.shape and torch.equal(p.view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)), \
            f"{where}: engine tensor {name} differs from its slice"


def train_one_step(trainer: Trainer, args, dims) -> None:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, args.vocab_size, (8, 10), generator=g)
    mask = torch.ones(8, 9, dtype=torch.float64)
    n = float(mask.sum())
    rows = slice(dims.dp_rank, None, dims.dp)  # this DP replica's rows, the global token count

    def loss_fn(lp, mb):
        return -(lp * mb["loss_mask"]).sum() / n, {}

    metrics = trainer.train_step({"input_ids": ids[rows], "loss_mask": mask[rows]}, loss_fn)
    assert metrics["update_ok"] == 1.0


def expect_failure(ws: WeightSync, *needles: str) -> str:
    try:
        ws()
    except WeightSyncError as e:
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in: {msg}"
        return msg
    raise AssertionError(f"no WeightSyncError; expected one naming {needles}")


def corrupt_received(ws: WeightSync, dims, hop: str) -> None:
    """Flip a byte of a piece another rank sent, on one rank, at one bucket: every rank fails."""
    buckets = ws.buckets
    if hop == "pp":  # the first bucket (stage 0), received by a last-stage rank
        bucket, rank, chunk, expert_rank = buckets[0], WORLD - 1, 0, None
    elif hop == "tp":  # a later bucket, rank 1 gets tp_rank 0's chunk
        bucket, rank, chunk, expert_rank = buckets[min(2, len(buckets) - 1)], 1, 0, None
    else:  # the first expert bucket, rank 1 (ep_rank 1) gets ep_rank 0's experts
        bucket = next(b for b in buckets if b.expert)
        rank, chunk, expert_rank = 1, 0, 0

    def hook(index, kind, buf):
        if dims.rank == rank and index == bucket.index and kind == hop:
            start = chunk * (buf.numel() // {"pp": 1, "tp": dims.tp, "ep": dims.ep}[hop])
            buf[start:start + 1].bitwise_xor_(0x10)

    item = bucket.items[0]
    name = item.names[expert_rank if expert_rank is not None else 0]
    ws.receive_hook = hook
    try:
        expect_failure(ws, f"rank {rank}: bucket {bucket.index}, {hop} hop", f"checksum mismatch in {name}")
    finally:
        ws.receive_hook = None


def corrupt_engine_copy(ws: WeightSync, dims) -> None:
    """A faulty copy into the engine on rank 2 (one value off): every rank fails, naming it."""
    original = weight_sync._copy_to_engine
    bucket = next(b for b in ws.buckets for it in b.items if it.names[0] == "decoder.final_layernorm.weight")

    engine_norm = ws.engine.model.state_dict()["model.norm.weight"]

    def targeted(dst, src):
        original(dst, src)
        if dims.rank == 2 and dst.data_ptr() == engine_norm.data_ptr():
            dst[0] += 1.0

    weight_sync._copy_to_engine = targeted
    try:
        expect_failure(ws, f"rank 2: bucket {bucket.index}: engine tensor model.norm.weight")
    finally:
        weight_sync._copy_to_engine = original


def diverge_tied_copy(ws: WeightSync, trainer: Trainer, dims) -> None:
    """The last stage's copy of tied embeddings off by one value on rank 3: every rank fails."""
    copy = trainer.gpt.output_layer.weight if dims.rank == WORLD - 1 else None
    if copy is not None:
        kept = copy.detach().clone()
        with torch.no_grad():
            copy[0, 0] += 1.0
    try:
        expect_failure(ws, f"rank {WORLD - 1}: bucket 0: tied embeddings: the last stage's copy")
    finally:
        if copy is not None:
            with torch.no_grad():
                copy.copy_(kept)
    ws()


def run_layout(tp: int, pp: int, ep: int, rollout_groups) -> dict:
    dims = init_parallel(tp=tp, pp=pp, ep=ep)
    out = {}
    hops = [h for h, n in (("pp", pp), ("tp", tp), ("ep", ep)) if n > 1]
    for case in (MOE if ep > 1 else DENSE):
        args = case_args(*case)
        hf0 = init_hf_state(args, SEED, torch.float64)
        trainer = Trainer(args, TrainerConfig(lr=1e-2, dtype="float64", micro_batch_size=4), dims, hf_state=hf0)
        syncs = {rtp: WeightSync(trainer, make_engine(args, rtp, rollout_groups[rtp], engine_dtype(case, rtp)),
                                 BUCKET_MB) for rtp in LAYOUTS[(tp, pp, ep)]}
        res = {"metrics": {}}
        want0 = weight_checksum(hf0, args)
        for rtp, ws in syncs.items():
            m = ws()
            assert_engine_holds(ws.engine, hf0, f"layout {(tp, pp, ep)} {case} rollout tp {rtp}")
            assert m["weight_checksum"] == want0, (m["weight_checksum"], want0)
            assert m["weight_sync_buckets"] >= 4 and m["weight_sync_peak_bytes"] <= ws.bucket_bytes, m
            assert max(b.gathered for b in ws.buckets) <= ws.bucket_bytes
            res["metrics"][rtp] = m
        res["checksum0"] = want0
        train_one_step(trainer, args, dims)
        hf1 = trainer.hf_state_dict()
        want1 = weight_checksum(hf1, args)
        assert want1 != want0
        for rtp, ws in syncs.items():
            m = ws()
            assert_engine_holds(ws.engine, hf1, f"layout {(tp, pp, ep)} {case} rollout tp {rtp} after a step")
            assert m["weight_checksum"] == want1
        res["checksum1"] = want1
        if case == (MOE if ep > 1 else DENSE)[0]:
            ws = syncs[LAYOUTS[(tp, pp, ep)][-1]]
            for hop in hops:
                corrupt_received(ws, dims, hop)
            corrupt_engine_copy(ws, dims)
            assert ws()["weight_checksum"] == want1  # the sync still works afterwards
            assert_engine_holds(ws.engine, hf1, "after the failures")
        if case == ("llama", True) and pp > 1:
            diverge_tied_copy(syncs[1], trainer, dims)
        out[case] = res
    # Keep the process group for the next layout; only Megatron's parallel state is rebuilt.
    teardown(dataclasses.replace(dims, owns_process_group=False))
    return out


def run_disaggregated(trainers: int, tp: int, pp: int, ep: int, rollout_tp: int) -> dict:
    dims = init_parallel(tp=tp, pp=pp, ep=ep, trainer_ranks=trainers)
    assert dims.role == ("trainer" if dims.rank < trainers else "rollout"), dims.role
    cfg = ParallelConfig(placement="disaggregated", rollout_ranks=WORLD - trainers, trainer_tp=tp, trainer_pp=pp,
                         trainer_ep=ep, rollout_tp=rollout_tp)
    groups = create_rollout_groups(Layout.build(cfg, WORLD, 4, 2, 4, num_experts=4))
    out = {}
    for case in (MOE if ep > 1 else DENSE):
        args = case_args(*case)
        hf0 = init_hf_state(args, SEED, torch.float64)
        if dims.trains:
            trainer = Trainer(args, TrainerConfig(lr=1e-2, dtype="float64", micro_batch_size=4), dims, hf_state=hf0)
            ws = WeightSync(trainer, None, BUCKET_MB, bridge=groups.bridge)
        else:
            engine = make_engine(args, rollout_tp, groups.tp_group, engine_dtype(case, rollout_tp))
            ws = WeightSync(None, engine, BUCKET_MB, bridge=groups.bridge, receiver=(dims, args, torch.float64))
        where = f"disaggregated {trainers} trainers tp, pp, ep = {(tp, pp, ep)}, rollout tp {rollout_tp}, {case}"
        m0 = ws()
        assert m0["weight_checksum"] == weight_checksum(hf0, args), where
        if not dims.trains:
            assert_engine_holds(engine, hf0, where)
            assert m0["weight_sync_wire_bytes"] == sum(b.gathered for b in ws.buckets)  # every bucket once
        if dims.trains:
            train_one_step(trainer, args, dims)
            hf1 = trainer.hf_state_dict()
        # the generating ranks cannot compute the new weights: rank 0 hands them over for the check
        box = [hf1 if dims.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        m1 = ws()
        assert m1["weight_checksum"] == weight_checksum(box[0], args) != m0["weight_checksum"], where
        if not dims.trains:
            assert_engine_holds(engine, box[0], where + " after a step")
        if case == (MOE if ep > 1 else DENSE)[0]:  # a corrupted bridge buffer on the last rank: every rank fails
            bucket = ws.buckets[-1]

            def hook(index, kind, buf):
                if dims.rank == WORLD - 1 and index == bucket.index and kind == "bridge":
                    buf[0:1].bitwise_xor_(0x10)

            ws.receive_hook = hook
            expect_failure(ws, f"rank {WORLD - 1}: bucket {bucket.index}, bridge hop", "checksum mismatch in")
            ws.receive_hook = None
            assert ws()["weight_checksum"] == m1["weight_checksum"]
        out[case] = {"checksum0": m0["weight_checksum"], "checksum1": m1["weight_checksum"], "metrics": m1}
    teardown(dataclasses.replace(dims, owns_process_group=False))
    return out


def main(out_dir: str) -> None:
    results = {}
    groups = None
    for layout in LAYOUTS:
        if groups is None:  # the rollout groups need the process group: created once, after the first init
            dims = init_parallel(*layout[:2], ep=layout[2])
            layout_cfg = Layout.build(ParallelConfig(rollout_tp=2), WORLD, 4, 2, 4)
            groups = {1: None, 2: create_rollout_groups(layout_cfg).tp_group}
            teardown(dataclasses.replace(dims, owns_process_group=False))
        t0 = time.perf_counter()
        results[layout] = run_layout(*layout, groups)
        print(f"rank {dist.get_rank()} layout tp, pp, ep = {layout}: {time.perf_counter() - t0:.2f} s", flush=True)
    for layout in DISAGG:
        t0 = time.perf_counter()
        results[("disagg", *layout)] = run_disaggregated(*layout)
        print(f"rank {dist.get_rank()} disaggregated {layout}: {time.perf_counter() - t0:.2f} s", flush=True)
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
