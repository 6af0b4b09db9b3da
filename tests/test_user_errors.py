"""Every bad input is refused before anything is written, a resume checks its
config against the run's, and every user error (a full disk included) ends in one line, exit 2.

Each case goes through the real CLI (``megarl.cli.main`` in this process; nothing here reaches
Megatron) and asserts: exit status 2, exactly one ``megarl: error:`` line naming the key or file,
the value and what is valid, no traceback, and nothing written (the run directory does not exist
afterwards, or its files are byte for byte what they were). Runs that must really train (the
resume fixture, a full disk mid-run, an accepted resume) are subprocesses.
"""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--config", str(ROOT / "configs/smoke.yaml")]
# The smallest run that writes checkpoints: 2 SFT steps, 2 RL steps of 2 prompts x 2 samples.
SMALL = [*SMOKE, "--set", "sft.steps=2", "--set", "rl_steps=2", "--set", "checkpoint_every=1",
         "--set", "rollout.max_new_tokens=16", "--set", "rollout.prompts_per_step=2",
         "--set", "rollout.group_size=2", "--set", "progress=false"]


def run_cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()  # drop what earlier calls left
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its content's hash; the advisory lock file is left out (a
    refused start takes and releases the lock, which records the taker)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def assert_refused(rc: int, err: str, run_dir: Path | None, *needles: str, before: dict | None = None) -> str:
    """Exit 2, one error line holding every needle, no traceback, nothing written. Returns the line."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("megarl: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    if run_dir is not None:
        if before is None:
            assert not run_dir.exists(), f"a refused start left {sorted(p.name for p in run_dir.iterdir())}"
        else:
            assert snapshot(run_dir) == before, "a refused start changed the run directory"
    return lines[0]


# ---------------------------------------------------------------- item 3: values out of range

RANGES = [  # (override, what the line must say: key=value and the valid range)
    ("rollout.top_p=1.5", ["rollout.top_p=1.5", "(0, 1]"]),
    ("rollout.temperature=-1", ["rollout.temperature=-1.0", ">= 0"]),
    ("rollout.temperature=nan", ["rollout.temperature=nan", ">= 0", "finite"]),
    ("rollout.temperature=.inf", ["rollout.temperature=inf", ">= 0", "finite"]),
    ("rollout.top_k=-1", ["rollout.top_k=-1", ">= 0"]),
    ("grpo.kl_coef=-1", ["grpo.kl_coef=-1.0", ">= 0"]),
    ("sft.lr=-1", ["sft.lr=-1.0", "> 0"]),
    ("grpo.clip_eps_low=-1", ["grpo.clip_eps_low=-1.0", "[0, 1]"]),
    ("rollout.device=tpu", ["rollout.device='tpu'", "cpu, cuda or cuda:N"]),
    ("rl_steps=-1", ["rl_steps=-1", ">= 0"]),
    ("sft.steps=-1", ["sft.steps=-1", ">= 0"]),
    ("checkpoint_every=-1", ["checkpoint_every=-1", ">= 0", "0: no checkpoints"]),
    ("keep_checkpoints=0", ["keep_checkpoints=0", ">= 1"]),
    ("keep_checkpoints=-1", ["keep_checkpoints=-1", ">= 1"]),
    ("rollout.group_size=1", ["rollout.group_size=1", ">= 2", "advantage is 0"]),
]


@pytest.mark.parametrize("command", ["train", "config"])
@pytest.mark.parametrize("override,needles", RANGES, ids=[r[0] for r in RANGES])
def test_out_of_range_value_is_refused(capsys, tmp_path, command, override, needles):
    """``megarl config`` refuses what ``train`` refuses (the ranges live in the config sections)."""
    run_dir = tmp_path / "run"
    extra = ["--run-dir", run_dir] if command == "train" else []
    rc, err = run_cli(capsys, command, *extra, *SMOKE, "--set", override)
    assert_refused(rc, err, run_dir, *needles)


def test_refused_start_removes_the_parent_folders_it_created(capsys, tmp_path):
    run_dir = tmp_path / "new" / "deeper" / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", "rollout.top_k=-1")
    assert_refused(rc, err, tmp_path / "new", "rollout.top_k=-1")


def test_refused_start_on_an_existing_folder_leaves_no_lock(capsys, tmp_path):
    """An existing run folder keeps exactly what it held: the lock file the refused start took is
    removed too (it used to stay behind)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "mine.txt").write_text("mine\n")
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", "rollout.top_k=-1")
    assert_refused(rc, err, None, "rollout.top_k=-1")
    assert sorted(p.name for p in run_dir.iterdir()) == ["mine.txt"]


def test_empty_run_dir_is_refused(capsys, tmp_path, monkeypatch):
    """``--run-dir ""`` used to run in the current directory, among the user's files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine\n")
    rc, err = run_cli(capsys, "train", "--run-dir", "", *SMOKE)
    assert_refused(rc, err, None, "--run-dir '' is empty", "current directory", "--run-dir runs/my_run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_run_dir_linked_to_a_foreign_folder_is_refused(capsys, tmp_path):
    """A run dir that is a symbolic link to a folder of other files used to be written into."""
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "a.jpg").write_bytes(b"jpg")
    (tmp_path / "run").symlink_to(foreign)
    rc, err = run_cli(capsys, "train", "--run-dir", tmp_path / "run", *SMOKE)
    assert_refused(rc, err, None, f"--run-dir {tmp_path / 'run'} is a symbolic link to {foreign}", "(a.jpg)",
                   "not a megarl run")
    assert sorted(p.name for p in foreign.iterdir()) == ["a.jpg"]


def test_resume_of_a_folder_without_a_run_says_to_start_without_it(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, "--resume", *SMOKE)
    assert_refused(rc, err, None, "--resume", "holds no run", "start the run without --resume")
    assert list(run_dir.iterdir()) == []


def test_context_too_short_for_the_prompts(capsys, tmp_path):
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", "model.max_position_embeddings=8")
    assert_refused(rc, err, run_dir, "model.max_position_embeddings=8", "rollout.max_new_tokens=96",
                   "max_position_embeddings >= ")


# ---------------------------------------------------------------- item 3/5: files and data

def _jsonl_args(tmp_path: Path, data: Path) -> list:
    from megarl.rl.tokenizer import CharTokenizer

    tok = tmp_path / "tok"
    if not tok.exists():
        CharTokenizer().save_pretrained(tok)
    return [*SMOKE, "--set", "data.source=jsonl", "--set", f"data.jsonl_path={data}",
            "--set", f"data.tokenizer_path={tok}", "--set", "sft.steps=0"]


@pytest.mark.parametrize("content,needles", [
    (b"", ["empty.jsonl", "holds no problems", '{"prompt": "12+7=", "answer": "19"}']),
    (json.dumps({"prompt": "1+2=" * 250_000, "answer": "3"}).encode() + b"\n",  # one 1 MB prompt
     ["data.jsonl:1", "1000000 tokens", "model.max_position_embeddings=256", "valid: a shorter prompt"]),
    (b'{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=\xff", "answer": "4"}\n',
     ["data.jsonl:2", "not UTF-8", "0xff", "save the file as UTF-8"]),
    ('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "12+\u00e9=", "answer": "3"}\n'.encode(),
     ["data.jsonl:2", "cannot be tokenized", "'\u00e9' at column 4", "valid: text the tokenizer"]),
    (b'{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": "4", "answer": "5"}\n',
     ["data.jsonl:2", "field 'answer' appears more than once", "give each field once"]),
], ids=["empty", "one-1MB-prompt", "not-utf8", "unencodable", "duplicate-key"])
def test_bad_prompt_file(capsys, tmp_path, content, needles):
    data = tmp_path / ("empty.jsonl" if not content else "data.jsonl")
    data.write_bytes(content)
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *_jsonl_args(tmp_path, data))
    assert_refused(rc, err, run_dir, *needles)


def test_code_reward_without_a_containing_sandbox_is_refused(capsys, tmp_path, monkeypatch):
    """data.reward=python_tests where bubblewrap cannot contain the programs (forced here, so the
    test means the same on a machine that has it): one line saying why and the two ways on;
    ``reward.allow_uncontained=true`` (the opt-out, by name) lets the set-up pass. Before, such a
    run started and warned at its first reward."""
    from megarl.config import load_config
    from megarl.rl import sandbox
    from megarl.setup_run import prepare_inputs

    monkeypatch.setitem(sandbox._probed, "bwrap_problem", "bubblewrap (bwrap) is not installed")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": "assert True"}) + "\n" for a in range(4)))
    args = [*_jsonl_args(tmp_path, data), "--set", "data.reward=python_tests"]
    rc, err = run_cli(capsys, "train", "--run-dir", tmp_path / "run", *args)
    assert_refused(rc, err, tmp_path / "run", "data.reward=python_tests runs model-written code",
                   "bubblewrap (bwrap) is not installed", "apt-get install bubblewrap", "reward.allow_uncontained=true")
    cfg = load_config(args[1], [*args[3::2], "reward.allow_uncontained=true"])
    assert len(prepare_inputs(cfg).problems) == 4


@pytest.mark.parametrize("command", ["train", "config"])
@pytest.mark.parametrize("content,needles", [
    (b"", ["empty.yaml is empty", "leave out --config"]),
    (b"rollout:\n  temperature: [0.7\n  top_k: 5\n", ["bad.yaml:3:", "not valid YAML"]),
    (bytes(range(256)) * 4, ["bad.yaml is not a text file", "not UTF-8", "expected a YAML mapping"]),
    (b"- 1\n- 2\n", ["bad.yaml must hold a mapping", "got a list"]),
], ids=["empty", "not-yaml", "binary", "a-list"])
def test_bad_config_file(capsys, tmp_path, command, content, needles):
    cfg = tmp_path / ("empty.yaml" if not content else "bad.yaml")
    cfg.write_bytes(content)
    run_dir = tmp_path / "run"
    extra = ["--run-dir", run_dir] if command == "train" else []
    rc, err = run_cli(capsys, command, *extra, "--config", cfg)
    assert_refused(rc, err, run_dir, *needles)


@pytest.mark.parametrize("command", ["train", "config"])
def test_override_that_is_not_yaml(capsys, tmp_path, command):
    run_dir = tmp_path / "run"
    extra = ["--run-dir", run_dir] if command == "train" else []
    rc, err = run_cli(capsys, command, *extra, "--set", "rollout=[1")
    assert_refused(rc, err, run_dir, "override 'rollout=[1'", "not valid YAML", "rollout is a section",
                   "--set rollout.")


def test_run_dir_that_is_a_file(capsys, tmp_path):
    run_dir = tmp_path / "notadir"
    run_dir.write_text("mine\n")
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE)
    assert_refused(rc, err, None, str(run_dir), "not a directory", "another --run-dir")
    assert run_dir.read_text() == "mine\n"


def test_bad_config_json_in_hf_folder(capsys, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden_size": 64,')
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", f"model.init_from_hf={hf}")
    assert_refused(rc, err, run_dir, str(hf / "config.json"), "not valid JSON", "expected the model's HF config")


def test_cuda_device_on_a_machine_without_one(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", "rollout.device=cuda:1")
    assert_refused(rc, err, run_dir, "rollout.device=cuda:1", "no CUDA device is available", "valid here: cpu")


def test_drafter_to_start_from_that_is_not_one(capsys, tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--set", "spec.enabled=true",
                      "--set", "spec.drafter.enabled=true", "--set", f"spec.drafter.init_from={folder}")
    assert_refused(rc, err, run_dir, f"spec.drafter.init_from={folder}", "model.safetensors")


def test_launch_env_with_world_size_but_no_rank(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE)
    assert_refused(rc, err, run_dir, "RANK not set", "WORLD_SIZE='2'", "set both")


def test_allow_config_change_needs_resume(capsys, tmp_path):
    run_dir = tmp_path / "run"
    rc, err = run_cli(capsys, "train", "--run-dir", run_dir, *SMOKE, "--allow-config-change")
    assert_refused(rc, err, run_dir, "--allow-config-change is for --resume")


# ---------------------------------------------------------------- item 4/5: resume

def megarl_subprocess(*args, script: str | None = None) -> subprocess.CompletedProcess:
    """``megarl ARGS`` in a fresh process (a run initialises Megatron, which is per process);
    ``script``: Python run first in that process (a fault to inject), then the CLI."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = f"{script or ''}\nimport sys\nfrom megarl.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


FULL_DISK_AT_STEP_2 = textwrap.dedent("""
    import errno, torch
    _save = torch.save
    def save(obj, f, *a, **k):  # a file object's write fails as on a full disk, after some bytes
        if "step_000002" in str(getattr(f, "name", f)):
            f.write(b"PK")
            raise OSError(errno.ENOSPC, "No space left on device")
        return _save(obj, f, *a, **k)
    torch.save = save
""")


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run whose disk fills while it writes checkpoint step_000002 (simulated: in its process a
    file write raises ENOSPC, as Python's do on a full disk). It leaves checkpoints step_000000
    (after SFT) and step_000001: the resume tests below start from it (one run for the module)."""
    run_dir = tmp_path_factory.mktemp("user_errors") / "run"
    return run_dir, megarl_subprocess("train", "--run-dir", run_dir, *SMALL, script=FULL_DISK_AT_STEP_2)


@pytest.fixture
def small_run(full_disk_run) -> Path:
    run_dir, proc = full_disk_run
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    return run_dir


@pytest.fixture
def run_copy(small_run, tmp_path) -> Path:
    shutil.copytree(small_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_corrupted_latest_checkpoint_names_the_previous_one(capsys, run_copy, damage):
    trainer = run_copy / "checkpoints" / "step_000001" / "trainer.pt"
    if damage == "deleted":
        trainer.unlink()
    else:
        trainer.write_bytes(trainer.read_bytes()[: trainer.stat().st_size // 2])
    before = snapshot(run_copy)
    rc, err = run_cli(capsys, "train", "--run-dir", run_copy, "--resume", *SMALL)
    assert_refused(rc, err, run_copy, "step_000001 is corrupted", "trainer.pt is missing" if damage == "deleted"
                   else "truncated", "the previous good checkpoint is step_000000", before=before)


@pytest.mark.parametrize("changes,needles", [
    (["seed=8"], ["seed: 7 -> 8"]),
    (["trainer.lr=0.1"], ["trainer.lr: 0.0003 -> 0.1"]),
    (["rollout.group_size=4"], ["rollout.group_size: 2 -> 4"]),
    (["seed=8", "trainer.lr=0.1", "rollout.group_size=4"],
     ["seed: 7 -> 8", "trainer.lr: 0.0003 -> 0.1", "rollout.group_size: 2 -> 4"]),
], ids=["seed", "lr", "group_size", "all-three"])
def test_resume_with_a_changed_config_is_refused(capsys, run_copy, changes, needles):
    before = snapshot(run_copy)
    sets = [a for c in changes for a in ("--set", c)]
    rc, err = run_cli(capsys, "train", "--run-dir", run_copy, "--resume", *SMALL, *sets)
    line = assert_refused(rc, err, run_copy, *needles, "config.yaml", "--allow-config-change", before=before)
    assert "free to change: rl_steps" in line  # what would be accepted


def test_deleted_config_yaml_does_not_turn_the_resume_check_off(capsys, run_copy):
    """RUN_DIR/config.yaml deleted: the resume compares against the config the checkpoint records
    (its state.json) and still refuses a changed seed; before, it resumed with a warning."""
    (run_copy / "config.yaml").unlink()
    before = snapshot(run_copy)
    rc, err = run_cli(capsys, "train", "--run-dir", run_copy, "--resume", *SMALL, "--set", "seed=99")
    assert_refused(rc, err, run_copy, "seed: 7 -> 99", str(run_copy / "checkpoints" / "step_000001" / "state.json"),
                   "--allow-config-change", before=before)


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory) -> tuple[Path, Path, list]:
    """A run on a JSONL prompt set with a checkpoint after its one step (run dir, data file, args)."""
    tmp = tmp_path_factory.mktemp("jsonl_run")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(1, 4) for b in range(1, 3)))
    args = [*_jsonl_args(tmp, data), "--set", "rl_steps=1", "--set", "checkpoint_every=1",
            "--set", "rollout.max_new_tokens=8", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2"]
    proc = megarl_subprocess("train", "--run-dir", tmp / "run", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run", data, args


def test_resume_on_a_changed_dataset_is_refused(capsys, jsonl_run):
    """Every answer of the JSONL prompt set changed between the start and the resume: refused,
    naming the file and the checkpoint (the prompt set's digest is recorded in each checkpoint);
    before, the resume trained on the changed data silently."""
    run_dir, data, args = jsonl_run
    original = data.read_text()
    rows = [json.loads(ln) for ln in original.splitlines()]
    data.write_text("".join(json.dumps({**r, "answer": r["answer"] + "0"}) + "\n" for r in rows))
    try:
        before = snapshot(run_dir)
        rc, err = run_cli(capsys, "train", "--run-dir", run_dir, "--resume", *args)
        assert_refused(rc, err, run_dir, f"the prompt set ({data}) is not the one",
                       str(run_dir / "checkpoints" / "step_000001"), "--allow-config-change", before=before)
    finally:
        data.write_text(original)
    assert run_cli(capsys, "config", *args)[0] == 0  # (the data is back as it was)


def test_malformed_middle_line_of_metrics_is_one_line(capsys, run_copy):
    """A corrupted line before the last one of metrics.jsonl: one error line naming file:line,
    exit 2, nothing changed; it used to end with a traceback, exit 1."""
    metrics = run_copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert len(lines) >= 2
    metrics.write_text(lines[0][:10] + "\n" + "".join(lines[1:]))
    before = snapshot(run_copy)
    rc, err = run_cli(capsys, "train", "--run-dir", run_copy, "--resume", *SMALL)
    assert_refused(rc, err, run_copy, f"{metrics}:1: malformed JSON line", "repair or remove that line",
                   before=before)


def test_resume_config_check_lists_what_may_change(small_run):
    """rl_steps, checkpoint_every, logging.* (and the rest of RESUME_MAY_CHANGE) pass; the others
    are returned (and logged) with --allow-config-change instead of refused."""
    from megarl.config import load_config
    from megarl.resume import RunDirError, check_resume_config

    free = load_config(SMOKE[1], [*SMALL[3::2], "rl_steps=5", "checkpoint_every=2", "keep_checkpoints=3",
                              "logging.tensorboard=false", "progress=true", "watchdog.timeout_s=120"])
    assert check_resume_config(small_run, free) == []
    changed = load_config(SMOKE[1], [*SMALL[3::2], "seed=8", "rl_steps=5"])
    with pytest.raises(RunDirError, match="seed: 7 -> 8"):
        check_resume_config(small_run, changed)
    assert check_resume_config(small_run, changed, allow_change=True) == ["seed: 7 -> 8"]


def test_resume_with_allowed_changes_runs_on(run_copy):
    """A resume that changes only what may change (more steps, another checkpoint interval, no
    TensorBoard) is accepted and continues from the last checkpoint (here: on a disk with room)."""
    proc = megarl_subprocess("train", "--run-dir", run_copy, "--resume", *SMALL, "--set", "rl_steps=3",
                             "--set", "checkpoint_every=3", "--set", "logging.tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(ln)["step"] for ln in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (run_copy / "checkpoints" / "step_000003").is_dir() and (run_copy / "hf").is_dir()
    assert "rl_steps: 3" in (run_copy / "config.yaml").read_text()  # the resumed run's config


# ---------------------------------------------------------------- item 5: a full disk

def test_full_disk_mid_run_names_the_file_and_the_last_good_checkpoint(full_disk_run):
    run_dir, proc = full_disk_run
    ckpts = run_dir / "checkpoints"
    assert_refused(proc.returncode, proc.stderr, None,
                   f"no space left on device writing {ckpts / 'step_000002' / 'trainer.pt'}; "
                   f"the last good checkpoint is {ckpts / 'step_000001'}")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000000", "step_000001"]  # no temporaries left


def _full_tmpfs_available(folder: Path) -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"],
                           capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


def test_library_writes_on_a_really_full_disk_raise_enospc(tmp_path):
    """torch.save(obj, path) reports a full disk as RuntimeError('... unexpected pos ...') and
    safetensors as SafetensorError('... (os error 28)'): megarl's writers turn both into the
    OSError(ENOSPC) naming the file that the CLI reports. On a real full filesystem: a 64 KiB
    tmpfs in a private mount namespace (``unshare -rm``; skipped where that is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _full_tmpfs_available(disk):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (unshare -rm)")
    code = textwrap.dedent(f"""
        import errno, torch
        from safetensors.torch import save_file
        from megarl.utils.fs import safetensors_os_errors, torch_save
        big = torch.zeros(100_000)
        for name, write in (("a.pt", lambda p: torch_save(big, p)),
                            ("b.safetensors", lambda p: save_file({{"x": big}}, p))):
            path = "{disk}/" + name
            try:
                with safetensors_os_errors(path):
                    write(path)
            except OSError as e:
                assert e.errno == errno.ENOSPC and e.filename == path, (e, e.filename)
                print("ENOSPC", name)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs {disk} && exec '
                           f'"{sys.executable}" -c "$0"', code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["ENOSPC a.pt", "ENOSPC b.safetensors"]


def test_no_space_message_without_checkpoints():
    from megarl.cli import _no_space_message

    exc = OSError(errno.ENOSPC, "No space left on device", "/r/.metrics.jsonl.tmp-ab12")
    assert _no_space_message(exc, None) == "no space left on device writing /r/metrics.jsonl"
    assert _no_space_message(exc, "/nonexistent/run").endswith(
        "; no checkpoint was written yet: make room and run the same command again (it starts the run again from "
        "the beginning)")
