"""Validate the simulator against measured CPU multi-process runs.

    .venv/bin/python -m megarl.cli bench schedule --config configs/tiny.yaml --nproc N --tail --ablations --speed-ref 5
        --work-dir D --json D.json
    .venv/bin/python benchmarks/validate_sim.py D [D2 ...] [--profile cpu] [--json OUT]

This machine's speed drifts by up to ~30% over tens of minutes, so a profile calibrated at another
time shifts every error alike. Calibrate right before and right after the runs
(``benchmarks/calibrate_sim.py --from-hf SFT_HF --out A.json`` ... ``--out B.json``) and pass
``--profile A.json --profile B.json``: predictions are the mean of the two, each one's step
prediction is printed too (their spread is the drift over the runs).

The drift also shows inside a chain of runs (the identical 4-process run: 2.63 s a step in one
repeat, 3.80 s in another). Runs benched with ``--speed-ref N`` carry the machine's speed right
before and after them (megarl/sim/probe.py ``SpeedReference``, a fixed one-process decode probe),
and so do profiles from calibrate_sim (``meta.speed_ref``, while its one-process figures were
timed): each run is then replayed with the profile's time figures scaled by run speed over
calibration speed (``LinearProfile.at_speed``). The speed factor and the prediction without it
(``raw``) are printed beside; ``--no-speed`` turns it off.

For each work dir (every run in it: ``baseline``, ``megarl``, ``tail`` and, with ``bench schedule
--ablations``, the megarl runs with one feature off; or a single ``megarl train`` run folder; the
process count is read from the bench's JSON next to it, ``<D>.json``, or ``--nproc``), every step is replayed through
the simulator with the calibrated ``cpu`` profile (benchmarks/sim_replay.py: the run's own response
lengths, length history and measured acceptance) and the mean step and rollout times are
printed predicted vs measured, with the relative error. The target is |error| <= 20% on step time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work_dirs", nargs="+", help="bench schedule --work-dir folders")
    ap.add_argument("--nproc", type=int, default=None, help="processes of the runs (default: from <work dir>.json)")
    ap.add_argument("--profile", action="append", default=None,
                    help="simulator profile (default cpu); give it twice, calibrated just before and just after "
                         "the runs, and predictions are the mean of the two (the spread is printed: the machine's "
                         "drift over the runs)")
    ap.add_argument("--no-speed", action="store_true",
                    help="do not scale the profile by the runs' speed reference (see above)")
    ap.add_argument("--json", default=None, help="also write every step's figures here")
    args = ap.parse_args()
    from megarl.sim.hardware import load_profile
    from megarl.sim.probe import speed_ratio
    from benchmarks.sim_replay import replay_run
    from megarl.utils.fs import atomic_write_text

    profiles = [load_profile(p) for p in (args.profile or ["cpu"])]
    rows, worst = [], 0.0
    print(f"{'runs':<28} {'variant':<12} {'procs':>5} {'step meas':>9} {'step pred':>9} {'err':>7} "
          f"{'rollout meas':>12} {'rollout pred':>12} {'err':>7} {'bubble meas/pred':>17} {'speed':>6} {'raw err':>7}"
          + (f" {'step pred per profile':>22}" if len(profiles) > 1 else ""))
    for d in map(Path, args.work_dirs):
        bench_json = d.with_suffix(".json") if d.with_suffix(".json").is_file() else d.parent / f"{d.name}.json"
        bench = json.loads(bench_json.read_text()) if bench_json.is_file() else {}
        nproc = args.nproc or bench.get("nproc")
        if nproc is None:
            raise SystemExit(f"validate_sim: no {bench_json}: pass --nproc")
        for variant, run in _runs(d):
            run_speed = None if args.no_speed else bench.get(variant, {}).get("speed_ref")
            factors = [speed_ratio(run_speed, p.meta["speed_ref"])
                       if run_speed and "speed_ref" in getattr(p, "meta", {}) else 1.0 for p in profiles]
            each = [replay_run(run, nproc, p.at_speed(f) if f != 1.0 else p) for p, f in zip(profiles, factors)]
            per = [e["summary"] for e in each]
            raw = [replay_run(run, nproc, p)["summary"] if f != 1.0 else x for p, f, x in zip(profiles, factors, per)]
            s = _mean_summary(per)
            raw_err = _mean_summary(raw)["step_rel_err"]
            r = {**each[0], "summary": s, "speed_factors": factors, "raw_step_rel_err": raw_err,
                 **({"per_profile": per} if len(per) > 1 else {})}
            worst = max(worst, abs(s["step_rel_err"]))
            rows.append({"work_dir": str(d), "variant": variant, "nproc": nproc, **r})
            print(f"{str(d)[-28:]:<28} {variant[:12]:<12} {nproc:>5} {s['meas_step_s']:>9.3f} {s['pred_step_s']:>9.3f} "
                  f"{s['step_rel_err']:>+7.1%} {s['meas_rollout_s']:>12.3f} {s['pred_rollout_s']:>12.3f} "
                  f"{s['rollout_rel_err']:>+7.1%} {s['meas_bubble_frac']:>8.3f}/{s['pred_bubble_frac']:.3f} "
                  f"{sum(factors) / len(factors):>6.3f} {raw_err:>+7.1%}"
                  + (" " + " / ".join(f"{x['pred_step_s']:.3f}" for x in per) if len(per) > 1 else ""))
    print(f"worst |step error|: {worst:.1%} (target 20%)")
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=1) + "\n")
    return 0


ORDER = ("baseline", "megarl", "tail")


def _runs(d: Path) -> list[tuple[str, Path]]:
    """The runs in ``d`` as (variant, folder): ``d`` itself if it is a run, else its subfolders that are, the
    bench's main variants first."""
    if (d / "metrics.jsonl").is_file():
        return [(d.name, d)]
    runs = [(p.name, p) for p in d.iterdir() if (p / "metrics.jsonl").is_file() and (p / "config.yaml").is_file()]
    if not runs:
        raise SystemExit(f"validate_sim: no run (metrics.jsonl + config.yaml) in {d} or its subfolders")
    return sorted(runs, key=lambda r: (ORDER.index(r[0]) if r[0] in ORDER else len(ORDER), r[0]))


def _mean_summary(summaries: list[dict]) -> dict:
    """The predictions averaged over profiles (measured figures are the same in each), errors redone."""
    out = dict(summaries[0])
    for k in out:
        if k.startswith("pred_"):
            out[k] = sum(x[k] for x in summaries) / len(summaries)
    out["step_rel_err"] = out["pred_step_s"] / out["meas_step_s"] - 1.0
    out["rollout_rel_err"] = out["pred_rollout_s"] / out["meas_rollout_s"] - 1.0
    return out


if __name__ == "__main__":
    sys.exit(main())
