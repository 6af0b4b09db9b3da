"""``megarl bench schedule`` end to end on a tiny config: both variants run on 2 processes from the
same weights, the JSON has the issue's keys, and megarl's scheduling sampled the very same
tokens as the plain synchronous baseline."""
import json

import pytest

from megarl.cli import main

OVERRIDES = ["sft.steps=0", "rollout.prompts_per_step=4", "rollout.group_size=3", "rollout.max_new_tokens=16",
             "task.num_prompts=8", "model.hidden_size=32", "model.intermediate_size=64", "trainer.micro_batch_size=4"]


@pytest.mark.multiproc
def test_bench_schedule_json_and_exactness(tmp_path, capsys):
    out = tmp_path / "sched.json"
    args = ["bench", "schedule", "--config", "configs/smoke.yaml", "--nproc", "2", "--steps", "3",
            "--json", str(out), "--work-dir", str(tmp_path / "work"), "--speed-ref", "2"]
    for o in OVERRIDES:
        args += ["--set", o]
    assert main(args) == 0
    rep = json.loads(out.read_text())
    for name in ("baseline", "megarl"):
        assert set(rep[name]) >= {"bubble_frac", "rollout_time_s", "step_time_s"}
        assert 0.0 <= rep[name]["bubble_frac"] <= 1.0
        assert len(rep[name]["steps"]) == 3
    assert rep["rollout_speedup"] == pytest.approx(rep["baseline"]["rollout_time_s"] / rep["megarl"]["rollout_time_s"])
    assert rep["samples_identical"] and rep["exact_match"]
    assert rep["weights_max_abs_diff"] <= rep["weight_tol"]
    assert rep["megarl"]["forward_reduction"] > 0 == rep["baseline"]["forward_reduction"]  # speculation ran
    for name in ("baseline", "megarl"):  # each run's samples and timeline are kept for megarl report
        assert (tmp_path / "work" / name / "rollouts.jsonl").exists()
        assert (tmp_path / "work" / name / "timeline.jsonl").exists()
    assert "rollout_speedup" in capsys.readouterr().out
    # --speed-ref 2: the machine's speed timed twice right before and twice right after each run, the same
    # work for both (validate_sim divides by a calibration's record of it).
    refs = [rep[name]["speed_ref"] for name in ("baseline", "megarl")]
    assert [[len(s) for s in r["samples_s"]] for r in refs] == [[2, 2], [2, 2]]
    assert refs[0]["what"] == refs[1]["what"] and all(r["median_s"] > 0 for r in refs)


def test_bench_schedule_rejects_bad_nproc(capsys):
    assert main(["bench", "schedule", "--nproc", "0", "--json", "/tmp/never.json"]) == 2
    assert "--nproc=0 is invalid" in capsys.readouterr().err
    assert main(["bench", "schedule", "--nproc", "2", "--speed-ref", "-1", "--json", "/tmp/never.json"]) == 2
    assert "--speed-ref=-1 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("name,off", [("no_spec", {"spec", "bubble"}), ("no_placement", {"placement"}),
                                      ("no_stream", {"stream"}), ("no_bubble_drafts", {"bubble"})])
def test_each_ablation_turns_off_its_feature_only(name, off):
    # --ablations: megarl with one feature off, as the simulator's replay reads the run's config
    # (speculation off also means no bubble drafts: they are drafts).
    import yaml

    from megarl.bench.schedule import ABLATIONS, COMMON, VARIANTS
    from megarl.config import dump_config, load_config
    from benchmarks.sim_replay import features_of

    def features(overrides):
        cfg = yaml.safe_load(dump_config(load_config("configs/tiny.yaml", [*COMMON, *overrides])))
        return features_of(cfg, 2) | ({"spec"} if cfg["spec"]["enabled"] else set())

    megarl = features(VARIANTS["megarl"])
    assert megarl == {"spec", "placement", "stream", "bubble"}
    assert features([*VARIANTS["megarl"], *ABLATIONS[name]]) == megarl - off
