"""How fast a fixed piece of work runs in n processes at once (calibrate_sim's contention
figures), and how fast the machine is right now (:class:`SpeedReference`).

:class:`SpeedProbe` keeps ``procs`` worker processes (each in its own session, one torch thread,
as torchrun starts megarl's workers) warmed up and blocked on a pipe; :meth:`measure` releases
them at once, each does ``reps`` runs of a fixed piece of work (``decode``: the engine generating
64 requests x 64 tokens; ``train``: the trainer's forward/backward of 32 rows x 128 tokens), and
it returns the wall time until the last one is done, per piece of work. Started together, the
workers overlap for the whole measurement (processes started one after the other race their
start-ups: one times alone while the other is still importing torch, and 2 processes come out
faster than 1). This machine's speed drifts by up to ~30% over minutes (other tenants of the
host), so :func:`alternate` times the n-process probe between two 1-process ones and takes the
median of several such ratios.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

KINDS = ("decode", "train")


def setup(config: str | None, from_hf: str | None = None):
    """(RunConfig, RunInputs) of ``config`` (None: the built-in defaults) with one torch thread
    and no SFT warm-up."""
    import torch

    torch.set_num_threads(1)
    from megarl.config import load_config
    from megarl.setup_run import prepare_inputs

    cfg = load_config(config, ["sft.steps=0"] + ([f"model.init_from_hf={from_hf}"] if from_hf else []))
    return cfg, prepare_inputs(cfg)


def make_engine(cfg, inputs, batch: int, spec: bool = False):
    """The run's engine shape: ``rollout.max_batch_size`` slots whatever the batch (the slot
    cache's size changes the cost of attention: 18% at 64 requests in 256 vs 64 slots). With
    ``spec``, speculation from the config's sources (none pre-generated: no bubble drafts)."""
    import dataclasses

    from megarl.engine import Engine, EngineConfig
    from megarl.models.llama import CausalLM
    from megarl.spec.speculator import Speculator

    model = CausalLM(inputs.args)
    spec_obj = Speculator(dataclasses.replace(cfg.spec, enabled=True, bubble_pregen=False)) if spec else None
    return Engine(model, EngineConfig(max_batch_size=max(batch, cfg.rollout.max_batch_size),
                                      max_seq_len=inputs.args.max_position_embeddings,
                                      dtype=cfg.rollout.dtype, device="cpu"), seed=0, spec=spec_obj)


def decode_requests(batch: int, length: int, prompt_len: int, vocab: int, group: int = 8):
    """``batch`` requests that never stop early (no stop token) for ``length`` tokens; groups of
    ``group`` share a prompt, as in GRPO."""
    from megarl.engine import Request, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=length, stop_token_ids=())
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, vocab, prompt_len)) for _ in range((batch + group - 1) // group)]
    return [Request(uid=i // group, sample_idx=i % group, prompt_ids=[int(t) for t in prompts[i // group]],
                    params=params) for i in range(batch)]


def train_batch(rng, vocab: int, n: int, w: int) -> dict:
    """``n`` rows of ``w`` random tokens, the first 10 a prompt (no loss)."""
    import torch

    ids = torch.as_tensor(rng.integers(3, vocab, (n, w)), dtype=torch.long)
    mask = torch.zeros((n, w - 1))
    mask[:, 10:] = 1.0
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.ones(n)}


def tiny_loss(logprobs, m):
    """A loss whose gradient is the logprobs' own (tiny, so repeated updates stay harmless)."""
    return (-(logprobs * m["loss_mask"]).sum() * 1e-6, {})


def work_fn(config: str | None, kind: str):
    """The probe's fixed piece of work of ``kind`` on ``config``'s model (None: the built-in
    defaults; random weights: the cost does not depend on them), warmed up once. Returns
    ``(fn, what)``: ``fn(i)`` does it once, ``what`` names the work and the model's shape (two
    timings compare only if their ``what`` is the same)."""
    if kind not in KINDS:
        raise ValueError(f"speed probe: kind {kind!r} is invalid; valid: {list(KINDS)}")
    cfg, inputs = setup(config)
    a = inputs.args
    what = (f"{kind} probe: {'64 requests x 64 tokens' if kind == 'decode' else '32 rows x 128 tokens'}, "
            f"{a.num_hidden_layers} layers x {a.hidden_size} hidden, vocab {a.vocab_size}")
    if kind == "decode":
        eng = make_engine(cfg, inputs, 64)
        reqs = decode_requests(64, 64, 12, inputs.args.vocab_size)
        fn = lambda i: eng.generate(reqs, step=i)
    else:
        from megarl.parallel.dist import init_parallel
        from megarl.trainer.trainer import Trainer

        trainer = Trainer(inputs.args, cfg.trainer, init_parallel(), seed=0, hf_dir=inputs.init_from_hf)
        b = train_batch(np.random.default_rng(0), inputs.args.vocab_size, 32, 128)

        def fn(i):
            if i % 8 == 0:
                trainer.begin_step()
            trainer.accumulate(b, tiny_loss)
    fn(0)
    return fn, what


class SpeedProbe:
    """``procs`` warmed-up workers doing ``kind`` work on ``config``'s model, released together by
    :meth:`measure` (module docstring). A context manager: the workers exit on close."""

    def __init__(self, config: str | None, procs: int, kind: str = "decode", reps: int = 3):
        if procs < 1:
            raise ValueError(f"speed probe: procs={procs} is invalid; valid range: >= 1")
        if kind not in KINDS:
            raise ValueError(f"speed probe: kind {kind!r} is invalid; valid: {list(KINDS)}")
        self.reps = reps
        cmd = [sys.executable, "-m", "megarl.sim.probe", "--kind", kind, "--reps", str(reps)]
        cmd += ["--config", str(config)] if config is not None else []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
             *filter(None, [os.environ.get("PYTHONPATH")])])
        self._ps = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env, start_new_session=True) for _ in range(procs)]
        try:
            # Each worker says "ready <what>" (work_fn): what the figures are timings of.
            self.what = [self._read(p, "ready").partition(" ")[2] for p in self._ps][0]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _read(p: subprocess.Popen, what: str) -> str:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"speed probe: a worker exited (code {p.wait()}) before it was {what}")
        return line.strip()

    def measure(self) -> float:
        """Seconds per piece of work with every worker doing ``reps`` of them at once: the wall
        time from releasing them to the last one done, over ``reps``. The last one, not each
        one's own timings: the OS does not share the cores evenly (with 4 training processes on
        2 cores, one rep takes 0.35 s in one worker and 1.7 s in another), and a phase ends when
        its last process is done."""
        t0 = time.perf_counter()
        for p in self._ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in self._ps:
            self._read(p, "done")
        return (time.perf_counter() - t0) / self.reps

    def close(self) -> None:
        for p in self._ps:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self._ps:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> SpeedProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def alternate(base: SpeedProbe, other: SpeedProbe, rounds: int) -> tuple[float, list[float], list[float]]:
    """``other``'s time over ``base``'s, robust to the machine's drift: base, other, base, ...
    (``rounds`` of ``other``), each ``other`` over the mean of the ``base`` before and after it;
    the median of those ratios. Returns (ratio, base times, other times)."""
    b, o = [base.measure()], []
    for _ in range(rounds):
        o.append(other.measure())
        b.append(base.measure())
    ratios = [x / (0.5 * (b[i] + b[i + 1])) for i, x in enumerate(o)]
    return float(np.median(ratios)), b, o


class SpeedReference:
    """How fast this machine is right now: the 1-process decode probe on the built-in default
    model (the same work whatever the run's config), measured ``samples`` times in a row.

    The machine's speed drifts: the identical 4-process run took 2.63 s a step in one repeat
    and 3.80 s in another, 45% apart, and a profile calibrated at one time predicts a run at
    another only as well as the two times' speeds agree. So ``megarl bench schedule`` records
    this reference right before and right after each run, ``benchmarks/calibrate_sim.py``
    around its one-process measurements, and ``benchmarks/validate_sim.py`` replays each run
    with the profile's time figures scaled by run speed over calibration speed
    (:func:`speed_ratio`). Several samples each time: consecutive ones vary by up to ~20%.
    A context manager; the probe's worker waits, idle, between records."""

    REPS = 2
    """Pieces of work per sample (0.24-0.3 s each here)."""
    WARMUP = 2
    """Samples timed and dropped at the start: the first one after the worker starts came out
    10-25% slower than the next ones in every record of the first validation repeats."""

    def __init__(self, samples: int = 5):
        if samples < 1:
            raise ValueError(f"speed reference: samples={samples} is invalid; valid range: >= 1")
        self.samples = samples
        self._probe = SpeedProbe(None, 1, "decode", self.REPS)
        try:
            for _ in range(self.WARMUP):
                self._probe.measure()
        except BaseException:
            self._probe.close()
            raise

    def sample(self) -> list[float]:
        """``samples`` timings now, seconds per piece of work."""
        return [round(self._probe.measure(), 5) for _ in range(self.samples)]

    def record(self, *samples: list[float]) -> dict:
        """What a run folder or a profile keeps: the work timed, the samples, their median."""
        flat = [x for s in samples for x in s]
        return {"what": self._probe.what, "samples_s": [list(s) for s in samples],
                "median_s": round(float(np.median(flat)), 5)}

    def close(self) -> None:
        self._probe.close()

    def __enter__(self) -> SpeedReference:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def speed_ratio(run: dict, calibration: dict) -> float:
    """How much slower the machine was for ``run`` than for ``calibration`` (two
    :meth:`SpeedReference.record` results): the ratio of their medians. Raises if they timed
    different work (another reference model or probe)."""
    for name, ref in (("run", run), ("calibration", calibration)):
        if not isinstance(ref, dict) or not {"what", "median_s"} <= set(ref) or not ref["median_s"] > 0:
            raise ValueError(f"speed reference of the {name} is invalid: {ref!r}; expected a SpeedReference.record() "
                             f"dict with 'what' and a positive 'median_s'")
    if run["what"] != calibration["what"]:
        raise ValueError(f"speed references timed different work: run {run['what']!r}, calibration "
                         f"{calibration['what']!r}; recalibrate with this version")
    return float(run["median_s"]) / float(calibration["median_s"])


def _worker(config: str | None, kind: str, reps: int) -> None:
    fn, what = work_fn(config, kind)
    print(f"ready {what}", flush=True)
    i = 1
    for line in sys.stdin:
        if line.strip() != "go":
            break
        for _ in range(reps):
            fn(i)
            i += 1
        print("done", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a speed-probe worker (megarl/sim/probe.py SpeedProbe starts them)")
    ap.add_argument("--config", default=None, help="run config (default: the built-in defaults)")
    ap.add_argument("--kind", choices=KINDS, default="decode")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    _worker(a.config, a.kind, a.reps)
