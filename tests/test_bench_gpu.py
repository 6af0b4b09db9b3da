"""The GPU runbook's dry run (issue 25): every part's code path on CPU with tiny shapes, so the
runbook cannot rot before a GPU is lent. One run of all parts plus the two self-test parts (one
that raises, one that hangs) placed before the real ones: the failure and the hang are recorded,
the hanging process is killed at its limit, and every later part still runs and writes its JSON;
the report and summary are written."""
import json
import os
import time
from pathlib import Path

import pytest

from megarl.bench.gpu import DEFAULT_PARTS, PARTS, merge, run_runbook

ORDER = ["env", "fail", "hang", *[p for p in DEFAULT_PARTS if p != "env"]]
HANG_LIMIT_S = 4.0


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    t0 = time.perf_counter()
    summary = run_runbook(out, ORDER, dry_run=True, timeouts={"hang": HANG_LIMIT_S},
                          work_dir=tmp_path_factory.mktemp("gpu-work"), echo=lambda *_: None)
    return out, summary, time.perf_counter() - t0


def test_failing_part_is_recorded_and_the_others_still_run(dry):
    out, summary, _ = dry
    parts = summary["parts"]
    assert list(parts) == ORDER
    assert parts["fail"]["status"] == "failed"
    assert "fails on purpose" in parts["fail"]["error"]  # the exception's own line, not just "exit 1"
    for name in DEFAULT_PARTS:  # including every part that ran after the failure and the hang
        assert parts[name]["status"] == "ok", (name, parts[name].get("error"), parts[name].get("log_tail", "")[-2000:])
        assert json.loads((out / f"{name}.json").read_text())


def test_part_over_its_limit_is_killed_and_recorded(dry):
    _, summary, _ = dry
    rec = summary["parts"]["hang"]
    assert rec["status"] == "timeout" and rec["rc"] is None
    assert HANG_LIMIT_S <= rec["seconds"] < HANG_LIMIT_S + 20  # the part sleeps an hour unless killed
    with pytest.raises(ProcessLookupError):
        os.kill(rec["pid"], 0)


def test_report_and_json_written(dry):
    out, summary, seconds = dry
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{p}.json" for p in DEFAULT_PARTS]
                                                           + ["report.md", "summary.json"])
    # at most 8 files: what the device tool brings back from $OUT
    assert len(list(out.iterdir())) <= 8
    assert json.loads((out / "summary.json").read_text())["parts"] == json.loads(json.dumps(summary["parts"]))
    report = (out / "report.md").read_text()
    assert "DRY RUN" in report
    for name in ORDER:
        assert f"| {name} |" in report
    for target in ("at batch 64", "of the bandwidth bound at batch 1", "verify K=4 at batch 16", "mismatch rate",
                   "exact (same tokens"):
        assert target in report
    assert "not measured" not in report.split("## gpu-marked tests")[0]  # every target got a figure
    engine = json.loads((out / "engine.json").read_text())
    assert engine["cuda_graphs"]["status"] == "not built"
    grpo = json.loads((out / "grpo_spec.json").read_text())
    assert grpo["comparison"]["steps_compared"] == 2
    assert "spec.enabled=true" in grpo["overrides"]
    tests = json.loads((out / "pytest.json").read_text())
    assert "tests/test_gpu.py" in tests["files"] and tests["counts"]["skipped"] >= 1  # no CUDA here
    print(f"dry run of {len(ORDER)} parts: {seconds:.1f} s")


def test_merge_of_two_calls(dry, tmp_path):
    out, _, _ = dry
    a, b = tmp_path / "a", tmp_path / "b"
    for d, names in ((a, ["env", "engine"]), (b, ["env", "grpo"])):
        d.mkdir()
        s = json.loads((out / "summary.json").read_text())
        s["parts"] = {n: s["parts"][n] for n in names}
        (d / "summary.json").write_text(json.dumps(s))
        for n in names:
            (d / f"{n}.json").write_text((out / f"{n}.json").read_text())
    merged = merge(tmp_path / "m", [a, b])
    assert list(merged["parts"]) == ["env", "engine", "grpo"] and len(merged["calls"]) == 2
    assert (tmp_path / "m" / "engine.json").is_file() and (tmp_path / "m" / "grpo.json").is_file()
    report = (tmp_path / "m" / "report.md").read_text()
    assert "part `identity` not run" in report


@pytest.mark.parametrize("args, says", [(["--parts", "env,bogus"], "--parts='env,bogus' is invalid"),
                                         (["--timeout", "env=0"], "--timeout 'env=0' is invalid"),
                                         (["--deadline", "-1"], "--deadline=-1.0 is invalid")])
def test_bad_arguments_one_error_line(tmp_path, capsys, args, says):
    from megarl.cli import main

    assert main(["bench", "gpu", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "valid" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing ran, nothing written


def test_budgets_fit_the_lease():
    """The default parts' limits together stay well inside the issue's 25 minutes."""
    assert sum(PARTS[p].budget_s for p in DEFAULT_PARTS) <= 21 * 60


def test_grpo_falls_back_without_determinism(tmp_path, monkeypatch):
    """A CUDA op with no deterministic kernel must cost the lease its determinism, not its GRPO
    figures: the run is repeated with deterministic=false and that is recorded."""
    import subprocess

    from megarl.bench import gpu_runs

    real, calls = subprocess.run, []

    def run(cmd, **kw):
        calls.append(list(cmd))
        if len(calls) == 1:  # what torch raises for such an op under use_deterministic_algorithms(True)
            return subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: index_add_cuda_ does not have a "
                                                            "deterministic implementation, but you set ...")
        return real(cmd, **kw)

    monkeypatch.setattr(gpu_runs.subprocess, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = gpu_runs.run_grpo("grpo", tmp_path, spec=False, dry_run=True)
    assert len(calls) == 2 and "deterministic=false" in calls[1] and "deterministic=false" not in calls[0]
    assert "index_add_cuda_" in out["deterministic_fallback"] and "deterministic=false" in out["overrides"]
    assert len(out["steps"]) == 2


def test_stopped_runbook_takes_its_running_part_with_it(tmp_path):
    """SIGTERM to the runner (a command cut off from outside) ends the part it is running: a part
    left behind would share the GPU with the next call's parts."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runner = subprocess.Popen([sys.executable, "-m", "megarl.bench.gpu", "--out", str(out), "--work-dir",
                               str(tmp_path / "w"), "--parts", "hang", "--timeout", "hang=300", "--dry-run"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = None
    for _ in range(600):  # until the hang part has started (its command line names this test's folder)
        found = subprocess.run(["pgrep", "-f", f"gpu_parts hang --json {out}/"], capture_output=True, text=True)
        if found.stdout.split():
            part = int(found.stdout.split()[0])
            break
        time.sleep(0.2)
    assert part is not None
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) != 0
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(part, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(part, signal.SIGKILL)
    raise AssertionError(f"the hang part (pid {part}) outlived the runner")
