"""Process layouts: rank lists in Megatron's order, and every bad layout rejected with a clear error."""
import os
import subprocess
import sys
import textwrap

import pytest

from megarl.parallel.layout import Layout, ParallelConfig

MODEL = dict(num_attention_heads=8, num_key_value_heads=4, num_layers=4)


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (8, 1, 4), (8, 4, 1), (12, 2, 3), (4, 1, 1)])
def test_trainer_groups_follow_megatron_rank_order(world, tp, pp):
    from megatron.core.parallel_state import RankGenerator

    model = dict(MODEL, num_layers=12)
    layout = Layout.build(ParallelConfig(trainer_tp=tp, trainer_pp=pp), world, **model)
    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for name, groups in (("tp", layout.trainer_tp_groups()), ("dp", layout.trainer_dp_groups()),
                         ("pp", layout.trainer_pp_groups())):
        assert sorted(groups) == sorted(gen.get_ranks(name)), name
    # every rank is in exactly one group of each kind
    for groups in (layout.trainer_tp_groups(), layout.trainer_dp_groups(), layout.trainer_pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(world))


def test_colocated_and_disaggregated_rollout_groups():
    co = Layout.build(ParallelConfig(trainer_tp=2, rollout_tp=4), 8, **MODEL)
    assert co.trainer_ranks == co.rollout_ranks == tuple(range(8))
    assert co.rollout_tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and co.rollout_dp == 2
    assert co.rollout_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dis = Layout.build(ParallelConfig(placement="disaggregated", rollout_ranks=6, trainer_tp=2, rollout_tp=2), 8, **MODEL)
    assert dis.trainer_ranks == (0, 1) and dis.rollout_ranks == (2, 3, 4, 5, 6, 7)
    assert dis.trainer_dp == 1 and dis.trainer_tp_groups() == [[0, 1]]
    assert dis.rollout_tp_groups() == [[2, 3], [4, 5], [6, 7]]
    assert "disaggregated" in dis.describe() and "DP=3" in dis.describe()


@pytest.mark.parametrize("cfg,world,model,match", [
    (dict(trainer_tp=3), 6, {}, r"trainer_tp=3 does not divide num_attention_heads=8; valid choices: \[1, 2, 4, 8\]"),
    (dict(trainer_tp=8), 8, {}, r"trainer_tp=8 does not divide num_key_value_heads=4"),
    (dict(trainer_tp=2, trainer_pp=2), 6, {}, r"trainer_tp \* trainer_pp = 2 \* 2 does not divide the 6 trainer"),
    (dict(trainer_pp=3), 3, {}, r"trainer_pp=3 does not divide num_hidden_layers=4"),
    (dict(trainer_ep=2), 4, {}, r"trainer_ep=2 needs a MoE model"),
    (dict(trainer_ep=3), 6, dict(num_experts=8), r"trainer_ep=3 does not divide num_experts=8"),
    (dict(trainer_ep=4, trainer_tp=2), 4, dict(num_experts=8), r"trainer_ep=4 does not divide the trainer's data-parallel size=2"),
    (dict(rollout_tp=3), 4, {}, r"rollout_tp=3 does not divide the 4 rollout processes"),
    (dict(rollout_tp=8), 8, {}, r"rollout_tp=8 does not divide num_key_value_heads=4"),
    (dict(placement="disaggregated", rollout_ranks=4), 4, {}, r"rollout_ranks=4 leaves no trainer"),
])
def test_bad_layouts_fail_with_the_field_named(cfg, world, model, match):
    with pytest.raises(ValueError, match=match):
        Layout.build(ParallelConfig(**cfg), world, **dict(MODEL, **model))


def test_config_validation():
    with pytest.raises(ValueError, match="placement='ring' is invalid"):
        ParallelConfig(placement="ring")
    with pytest.raises(ValueError, match="needs placement=disaggregated"):
        ParallelConfig(rollout_ranks=2)
    with pytest.raises(ValueError, match="valid range: >= 1"):
        ParallelConfig(placement="disaggregated")
    with pytest.raises(ValueError, match="trainer_tp=0 is invalid"):
        ParallelConfig(trainer_tp=0)


WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from megarl.parallel.layout import Layout, ParallelConfig, create_rollout_groups
    dist.init_process_group("gloo")
    layout = Layout.build(ParallelConfig(placement="disaggregated", rollout_ranks=2, rollout_tp=2), 3,
                          num_attention_heads=4, num_key_value_heads=2, num_layers=2)
    g = create_rollout_groups(layout)
    rank = dist.get_rank()
    x = torch.tensor([float(rank + 1)])
    if g.tp_group is not None:
        dist.all_reduce(x, group=g.tp_group)
    with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:  # stdout of ranks interleaves
        f.write(f"rank {rank} group {g.group_index} sum {x.item()}")
    dist.destroy_process_group()
""")


def test_rollout_groups_created_on_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)]
    # rank 0 trains only (no rollout group); ranks 1 and 2 form one TP group: 2 + 3 = 5
    assert lines == ["rank 0 group -1 sum 1.0", "rank 1 group 0 sum 5.0", "rank 2 group 0 sum 5.0"]


def test_run_layout_check_for_disaggregated_placement(monkeypatch):
    """A disaggregated run is accepted (trainers first, generating ranks last); stream training is
    refused with it, naming the fix."""
    from megarl.config import load_config
    from megarl.setup_run import check_layout, prepare_inputs

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = load_config("configs/smoke.yaml", ["parallel.placement=disaggregated", "parallel.rollout_ranks=1",
                                             "parallel.trainer_tp=1"])
    inputs = prepare_inputs(cfg)
    assert (inputs.layout.trainer_ranks, inputs.layout.rollout_ranks) == ((0, 1, 2), (3,))
    stream = load_config("configs/smoke.yaml", ["parallel.placement=disaggregated", "parallel.rollout_ranks=1",
                                                "stream_train=true"])
    with pytest.raises(ValueError, match="stream_train=true needs parallel.placement=colocated"):
        check_layout(stream, inputs.args, 4)


def test_run_layout_check_for_elastic_rollout_tp(monkeypatch):
    """tail.long_rollout_tp (elastic rollout TP) needs tail batching and a rollout TP the heads and
    the world allow; the error names the field."""
    from megarl.config import load_config
    from megarl.setup_run import check_layout, prepare_inputs

    monkeypatch.setenv("WORLD_SIZE", "4")
    ok = load_config("configs/smoke.yaml", ["tail.enabled=true", "tail.long_rollout_tp=2"])
    args = prepare_inputs(ok).args
    for overrides, match in ((["tail.long_rollout_tp=2"], "does not go with tail.enabled=false"),
                             (["tail.enabled=true", "tail.long_rollout_tp=2", "stream_train=true"],
                              "does not go with stream_train=true"),
                             (["tail.enabled=true", "tail.long_rollout_tp=3"], "parallel.rollout_tp=3 does not divide")):
        with pytest.raises(ValueError, match=match):
            check_layout(load_config("configs/smoke.yaml", overrides), args, 4)
