"""The GPU runbook's dry run: every part's code path on CPU with tiny shapes, so the runbook
cannot rot before a GPU machine runs it. One run of the quick profile's parts, with the two
self-test parts (one that raises, one that hangs) placed before the real ones: the failure and
the hang are recorded, the hanging process is killed at its limit, and every later part still
runs and writes its rows and result. Then the ways a part can be cut: killed mid-way (its rows
in the report, the report naming where it stopped), the whole command killed (the report on
disk already holds the running part's rows), the runner stopped (its part goes with it)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu.runbook.runner import DEFAULT_PARTS, failed_parts, main, merge, part_env, run_runbook
from benchmarks.gpu.runbook.profiles import BUDGETS_S, DEADLINE_S, ORDER as PROFILE_ORDER
from benchmarks.gpu.runbook.rows import read_rows

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["env", "fail", "hang", *[p for p in DEFAULT_PARTS if p != "env"]]
HANG_LIMIT_S = 4.0


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    t0 = time.perf_counter()
    summary = run_runbook(out, ORDER, dry_run=True, timeouts={"hang": HANG_LIMIT_S}, profile="quick",
                          work_dir=tmp_path_factory.mktemp("gpu-work"), echo=lambda *_: None)
    return out, summary, time.perf_counter() - t0


def _runner(out: Path, work: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.runbook", "--out", str(out), "--work-dir", str(work),
                             "--dry-run", "--profile", "quick", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _wait_rows(path: Path, n: int, timeout_s: float = 240) -> list[dict]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows, _ = read_rows(path)
        if len(rows) >= n:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} rows in {timeout_s} s")


def _running_pid(out: Path, part: str, timeout_s: float = 60) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            rec = json.loads((out / "summary.json").read_text())["parts"].get(part, {})
        except (OSError, ValueError):
            rec = {}
        if rec.get("status") == "running":
            return rec["pid"]
        time.sleep(0.1)
    raise AssertionError(f"summary.json never showed {part} running")


def test_quick_profile_dry_run_passes(dry):
    out, summary, seconds = dry
    parts = summary["parts"]
    assert list(parts) == ORDER and summary["profile"] == "quick"
    assert parts["fail"]["status"] == "failed"
    assert "fails on purpose" in parts["fail"]["error"]  # the exception's own line, not just "exit 1"
    for name in DEFAULT_PARTS:  # including every part that ran after the failure and the hang
        assert parts[name]["status"] == "ok", (name, parts[name].get("error"), parts[name].get("log_tail", "")[-2000:])
        rows, result = read_rows(out / f"{name}.jsonl")
        assert result is not None and rows and parts[name]["rows"] == len(rows)
    print(f"dry run of {len(ORDER)} parts (quick profile): {seconds:.1f} s; per part: "
          + ", ".join(f"{n} {parts[n]['seconds']:.1f} s" for n in ORDER))


def test_part_over_its_limit_is_killed_and_recorded(dry):
    _, summary, _ = dry
    rec = summary["parts"]["hang"]
    assert rec["status"] == "timeout" and rec["rc"] is None
    assert HANG_LIMIT_S <= rec["seconds"] < HANG_LIMIT_S + 20  # the part sleeps an hour unless killed
    with pytest.raises(ProcessLookupError):
        os.kill(rec["pid"], 0)


def test_rows_report_and_at_most_8_files(dry):
    out, summary, _ = dry
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{p}.jsonl" for p in DEFAULT_PARTS]
                                                           + ["report.md", "summary.json"])
    assert len(list(out.iterdir())) <= 8  # what comes back from the GPU machine
    report = (out / "report.md").read_text()
    assert "DRY RUN" in report and "## Parts (profile quick)" in report
    for name in ORDER:
        assert f"| {name} |" in report
    for target in ("at batch 64", "of the bandwidth bound at batch 1", "verify K=4 at batch 16", "mismatch rate",
                   "exact (same tokens"):
        assert target in report
    assert "not measured" not in report.split("## gpu-marked tests")[0]  # every target got a figure
    # a row per unit of work: engine per batch and KV cache, GRPO per step, identity per KV cache step
    engine_rows = [r["row"] for r in read_rows(out / "engine.jsonl")[0]]
    assert {"batch 1 generate", "batch 1 slots", "batch 1 paged", "batch 64 paged", "verify k4 b16 paged"} \
        <= set(engine_rows)
    assert [r["row"] for r in read_rows(out / "grpo.jsonl")[0]] == ["step 1", "step 2"]
    _, grpo = read_rows(out / "grpo_spec.jsonl")
    assert grpo["comparison"]["steps_compared"] == 2 and "spec.enabled=true" in grpo["overrides"]
    assert grpo["nondeterministic_ops"] == [] and "peak_gib" in grpo  # (None on a CPU)
    # the on-policy check of every step (bf16 engine vs trainer on a GPU) comes back
    assert all(isinstance(st.get("logprob_diff_max"), float) for st in grpo["steps"])
    assert "| logprob_diff_max |" in report
    test_rows, tests = read_rows(out / "pytest.jsonl")
    assert [r["row"] for r in test_rows] == [f"file {f}" for f in tests["files"]]
    assert all("peak_gib" in r for r in test_rows)  # (None on a CPU: the file's pytest never used CUDA)
    assert "tests/test_gpu.py" in tests["files"] and tests["counts"]["skipped"] >= 1  # no CUDA here


def test_part_killed_midway_keeps_its_rows_in_the_report(tmp_path):
    """SIGKILL to the engine part after 3 rows: the runner records it as killed, and the report
    lists every row it finished and names the last one as where it stopped."""
    out = tmp_path / "out"
    runner = _runner(out, tmp_path / "w", "--parts", "env,engine")
    try:
        pid = _running_pid(out, "engine")
        rows = _wait_rows(out / "engine.jsonl", 3)
        os.killpg(pid, signal.SIGKILL)
        assert runner.wait(timeout=120) == 1
    finally:
        runner.kill()
    rows, result = read_rows(out / "engine.jsonl")
    assert result is None and len(rows) >= 3
    rec = json.loads((out / "summary.json").read_text())["parts"]["engine"]
    assert rec["status"] == "failed" and "killed by signal 9" in rec["error"]
    assert rec["rows"] == len(rows) and rec["last_row"] == rows[-1]["row"]
    report = (out / "report.md").read_text()
    assert f"### engine: cut, {len(rows)} rows finished, the last `{rows[-1]['row']}`" in report
    cut = report.split("## Cut parts")[1].split("## Targets")[0]
    for r in rows:
        assert f"`{r['row']}` at" in cut
    assert "| engine | failed |" in report and "| env | ok |" in report


def test_whole_command_killed_leaves_the_running_parts_rows(tmp_path):
    """The command cut off from outside (SIGKILL to the runner, then its part): the report on disk
    already lists the rows of the part that was running, as running."""
    out = tmp_path / "out"
    runner = _runner(out, tmp_path / "w", "--parts", "rows", "--timeout", "rows=300")
    pid = None
    try:
        pid = _running_pid(out, "rows")
        _wait_rows(out / "rows.jsonl", 6)
        deadline = time.time() + 30  # the runner puts new rows into the report within a second
        while "`row 5`" not in (out / "report.md").read_text() and time.time() < deadline:
            time.sleep(0.1)
        runner.kill()
        runner.wait(timeout=30)
    finally:
        runner.kill()
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
    report = (out / "report.md").read_text()
    assert "| rows | running |" in report and "### rows: cut," in report
    assert "still running when this report was written" in report
    assert "`row 0` at" in report and "`row 5` at" in report


def test_stopped_runbook_takes_its_running_part_with_it(tmp_path):
    """SIGTERM to the runner (a command cut off from outside) ends the part it is running: a part
    left behind would share the GPU with the next command's parts."""
    out = tmp_path / "out"
    runner = _runner(out, tmp_path / "w", "--parts", "hang", "--timeout", "hang=300")
    part = _running_pid(out, "hang")
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) != 0
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(part, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(part, signal.SIGKILL)
    raise AssertionError(f"the hang part (pid {part}) outlived the runner")


def test_rerun_failed_picks_what_did_not_finish(tmp_path):
    prev = tmp_path / "prev"
    prev.mkdir()
    status = {"env": "ok", "pytest": "failed", "engine": "ok", "grpo": "ok", "grpo_spec": "timeout", "identity": None}
    (prev / "summary.json").write_text(json.dumps({"parts_requested": list(PROFILE_ORDER), "parts": {
        n: {"status": s} for n, s in status.items() if s}}))
    # identity never started (the command ended first); grpo_spec needs grpo's run, not in this work folder
    assert failed_parts(prev, tmp_path / "work") == ["pytest", "grpo", "grpo_spec", "identity"]
    (tmp_path / "work" / "grpo").mkdir(parents=True)
    (tmp_path / "work" / "grpo" / "metrics.jsonl").write_text("{}\n")
    assert failed_parts(prev, tmp_path / "work") == ["pytest", "grpo_spec", "identity"]


def test_rerun_failed_command_runs_only_those(tmp_path, capsys):
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "summary.json").write_text(json.dumps({"parts_requested": ["env", "fail"], "parts": {
        "env": {"status": "ok"}, "fail": {"status": "failed"}}}))
    out = tmp_path / "out"
    assert main(["--out", str(out), "--work-dir", str(tmp_path / "w"), "--rerun-failed", str(prev),
                 "--dry-run", "--profile", "quick"]) == 1
    assert list(json.loads((out / "summary.json").read_text())["parts"]) == ["fail"]
    (prev / "summary.json").write_text(json.dumps({"parts_requested": ["env"], "parts": {"env": {"status": "ok"}}}))
    assert main(["--out", str(tmp_path / "none"), "--rerun-failed", str(prev)]) == 0
    assert "nothing to rerun" in capsys.readouterr().out and not (tmp_path / "none").exists()


def test_merge_of_a_run_and_its_rerun(dry, tmp_path):
    out, _, _ = dry
    a, b = tmp_path / "a", tmp_path / "b"
    s = json.loads((out / "summary.json").read_text())
    for d, names in ((a, ["env", "engine", "grpo"]), (b, ["env", "grpo"])):
        d.mkdir()
        d_s = {**s, "parts": {n: dict(s["parts"][n]) for n in names}}
        if d is b:
            d_s["parts"]["grpo"]["status"] = "timeout"  # failed again: the first run's figures stay
        (d / "summary.json").write_text(json.dumps(d_s))
        for n in names:
            (d / f"{n}.jsonl").write_text((out / f"{n}.jsonl").read_text())
    merged = merge(tmp_path / "m", [a, b])
    assert list(merged["parts"]) == ["env", "engine", "grpo"] and len(merged["commands"]) == 2
    assert merged["parts"]["grpo"]["status"] == "ok"
    assert (tmp_path / "m" / "engine.jsonl").is_file() and (tmp_path / "m" / "grpo.jsonl").is_file()
    assert "part `identity` not run" in (tmp_path / "m" / "report.md").read_text()


@pytest.mark.parametrize("args, says", [(["--parts", "env,bogus"], "--parts='env,bogus' is invalid"),
                                         (["--timeout", "env=0"], "--timeout 'env=0' is invalid"),
                                         (["--deadline", "-1"], "--deadline=-1.0 is invalid"),
                                         (["--set", "engine.bogus=1"], "unknown config key engine.'bogus'"),
                                         (["--set", "engine.batch_sizes=[0]"], "engine.batch_sizes=[0] is invalid"),
                                         (["--set", "prompt_len=8"], "--set 'prompt_len=8' is invalid"),
                                         (["--parts", "env", "--rerun-failed", "x"], "give one of them")])
def test_bad_arguments_one_error_line(tmp_path, capsys, args, says):
    assert main(["--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "megarl: error:" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing ran, nothing written


def test_quick_profile_fits_one_command():
    """The quick profile's limits and deadline leave room in one 420 s command for the interpreter,
    the wheel install and the report (docs/gpu/README.md: the estimate per part)."""
    assert list(PROFILE_ORDER) == ["env", "pytest", "engine", "grpo", "grpo_spec", "identity"]
    assert sum(BUDGETS_S["quick"].values()) <= DEADLINE_S["quick"] <= 420 - 20
    assert sum(BUDGETS_S["full"].values()) <= DEADLINE_S["full"]


def _probe_wheel(folder: Path, name: str) -> None:
    """A minimal pure-Python wheel of one module ``name``."""
    import zipfile

    folder.mkdir(parents=True)
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


def test_run_all_sets_shapes_and_turns_compile_off(tmp_path):
    """The runbook script end to end on CPU (env part only): a wheel of a module the interpreter
    lacks is installed from the wheels folder, shapes from the command line reach the part, and
    the parts run with torch.compile off, so Megatron's fused kernels run eager."""
    out = tmp_path / "out"
    _probe_wheel(tmp_path / "wheels" / "ifmissing", "megarl_probe_mod")
    env = {**os.environ, "OUT": str(out), "PARTS": "env", "WHEELS": str(tmp_path / "wheels"), "PYTHON": sys.executable,
           "MEGARL_GPU_WORK": str(tmp_path / "w"), "MEGARL_SITE": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHDYNAMO_DISABLE", None)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run_all.sh"), "--dry-run", "--set",
                           "env.matmul_n=48"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "site" / "megarl_probe_mod.py").is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no megatron-core wheel" in proc.stdout  # said, and the parts still ran
    rows, result = read_rows(out / "env.jsonl")
    assert result["torchdynamo_disable"] == "1" and result["ceilings"]["matmul_n"] == 48
    assert [r["row"] for r in rows] == ["versions", "allreduce", "copy", "matmul"]
    assert result["allreduce"]["equal"] and result["allreduce"]["world_size"] == 1
    check = ("from megatron.core.jit import jit_fuser\n"
             "def f(x): return x\n"
             "assert jit_fuser(f) is f, 'megatron jit_fuser compiles'\n")
    assert subprocess.run([sys.executable, "-c", check], env=part_env(False), capture_output=True,
                          timeout=120).returncode == 0


def test_child_records_nondeterministic_ops_instead_of_failing(tmp_path):
    """Under deterministic: true an op with no deterministic kernel raises; the runbook's child
    wrapper makes it warn, records it, and the run goes on (no rerun of the whole part)."""
    (tmp_path / "nondet_mod.py").write_text(
        "import torch\n"
        "torch.use_deterministic_algorithms(True)\n"
        "torch.zeros(5).put_(torch.tensor([0, 0]), torch.ones(2))\n"  # put_ has no deterministic kernel
        "print('went on')\n")
    info = tmp_path / "info.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.runbook.child", str(info), "nondet_mod"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "went on" in proc.stdout
    got = json.loads(info.read_text())
    assert got["peak_gib"] is None
    assert any("put_ does not have a deterministic" in op for op in got["nondeterministic_ops"])
