"""Trainer speed per real token: Megatron-core trainer vs the HF model, and the
GRPO step before/after (old-logprob forward, padding, token-budget micro-batches).

One synthetic GRPO batch: ``--rows`` rows, each a ``--prompt-len``-token prompt and a long-tailed
response (``max_new * u^3`` tokens, u uniform: mean ~max_new / 4, as a rollout whose tail wastes
~75% of a padded batch's slots), random token ids, random advantages. Both sides hold the same
weights (``--model tiny``: configs/tiny.yaml's Qwen2 with 4 layers, hidden 128, seeded; or an HF
folder, e.g. ~/.cache/megarl/models/smollm2 with its real weights), fp32, ``--threads`` torch
threads each, in one process.

Part 1, forward/backward at equal micro-batches: the rows sorted by length and cut into the same
micro-batches of ``--micro-batch`` rows on both sides; per micro-batch the GRPO loss (ratio to
the same forward's detached logprobs) and its backward. HF (``transformers``, SDPA attention):
the rows right padded to the micro-batch's longest with an attention mask, full logits,
``log_softmax`` in fp32, gathered. Megatron: ``Trainer.begin_step`` + ``accumulate`` (packed
rows, output layer on the loss positions only; and with ``pack`` off, padded rows). Timed A/B
alternated, ``--reps`` rounds after one warm-up; the table gives ms per 1000 real tokens (prompt +
response tokens, padding not counted), wall (median and min over rounds) and CPU time of the process
(median; on a shared machine the steadier of the two), and HF's time over Megatron's.

Part 2, the GRPO step (``megarl.stages.update.grpo_update``: forward/backward and the optimizer
step) with the separate old-logprob forward on/off, padded/packed rows, and micro-batches of
``--micro-batch`` rows or of up to ``--budget`` tokens; the variants alternated round by round.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_trainer.py --model tiny --rows 64 --micro-batch 64
    PYTHONPATH=. .venv/bin/python benchmarks/bench_trainer.py --model ~/.cache/megarl/models/smollm2 \\
        --rows 16 --micro-batch 8 --max-new 160
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import statistics
import tempfile
import time
import types
import warnings

import torch


def make_rows(n: int, prompt_len: int, max_new: int, vocab: int, seed: int):
    """Groups (of 8 rows) of fake rollout results: ``prompt_ids``, ``tokens``, ``logprobs``, ``temperature``."""
    g = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(n):
        u = float(torch.rand((), generator=g))
        k = max(4, int(max_new * u ** 3))
        ids = torch.randint(3, vocab, (prompt_len + k,), generator=g).tolist()
        results.append(types.SimpleNamespace(prompt_ids=ids[:prompt_len], tokens=ids[prompt_len:],
                                             logprobs=[0.0] * k, temperature=1.0))
    rewards = torch.randint(0, 2, (n,), generator=g).tolist()
    return [types.SimpleNamespace(results=results[i:i + 8], rewards=rewards[i:i + 8]) for i in range(0, n, 8)]


def build(model: str, threads: int):
    """(ModelArgs, HF state dict, HF transformers model, folder) for ``model``."""
    import transformers

    from megarl.models.config import ModelArgs
    from megarl.models.hf_io import load_hf_state_dict, read_hf_config, save_hf_model

    torch.set_num_threads(threads)
    if model == "tiny":
        from megarl.config import load_config
        from megarl.models.init_weights import init_hf_state
        from megarl.setup_run import prepare_inputs

        cfg = load_config("configs/tiny.yaml", ["model.num_hidden_layers=4"])
        args = prepare_inputs(cfg).args
        state = init_hf_state(args, 0, torch.float32)
        folder = save_hf_model(state, args, os.path.join(tempfile.mkdtemp(), "tiny"))
    else:
        folder = os.path.expanduser(model)
        args = ModelArgs.from_hf_config(read_hf_config(folder))
        state = load_hf_state_dict(folder, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                           attn_implementation="sdpa")
    return args, state, hf, str(folder)


def hf_fwd_bwd(hf, batch, micro_batch: int, num_tokens: float) -> None:
    """The GRPO loss's forward/backward on the HF model, micro-batches of the Megatron trainer's
    rows (length order), each right padded to its longest row."""
    from megarl.rl.grpo import grpo_loss
    from megarl.trainer.micro_batches import length_order, micro_batches, row_lengths

    hf.zero_grad(set_to_none=False)
    for mb in micro_batches(batch, micro_batch, length_order(batch)):
        ids = mb["input_ids"]
        attention_mask = (torch.arange(ids.shape[1])[None] < row_lengths(mb)[:, None]).long()
        logits = hf(input_ids=ids, attention_mask=attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss, _ = grpo_loss(lp, lp.detach(), mb["advantages"], mb["loss_mask"], num_tokens)
        loss.backward()


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``. On a shared machine the wall time
    depends on the neighbours; the CPU time (both threads' work) much less: both are reported."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def summary(runs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(median wall, min wall, median CPU) seconds."""
    wall, cpu = [w for w, _ in runs], [c for _, c in runs]
    return statistics.median(wall), min(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' or an HF folder (real weights)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=0, help="token budget of part 2's last variant (0: 8 * mean row)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-step", action="store_true", help="part 1 only")
    ap.add_argument("--skip-fwd-bwd", action="store_true", help="part 2 only")
    ap.add_argument("--variants", default="0,1,2,3,4", help="part 2's variants to run (indices, in table order)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N ops (torch profiler, self CPU time) "
                    "of one forward/backward on each side, then stop")
    a = ap.parse_args()

    from megarl.parallel.dist import init_parallel
    from megarl.rl.grpo import GRPOConfig, UpdateSpec, grpo_batch
    from megarl.stages.update import grpo_update
    from megarl.trainer.trainer import Trainer, TrainerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dims = init_parallel(tp=1, pp=1)
    args, state, hf, folder = build(a.model, a.threads)
    hf.train()
    tr = Trainer(args, TrainerConfig(lr=1e-7, micro_batch_size=a.micro_batch), dims, hf_state=state)
    groups = make_rows(a.rows, a.prompt_len, a.max_new, args.vocab_size, seed=0)
    batch = grpo_batch(groups, 8, 0, True, 1.0)
    num_tokens = float(batch["loss_mask"].sum())
    real = int(sum(len(r.prompt_ids) + len(r.tokens) for g in groups for r in g.results))
    padded = a.rows * batch["input_ids"].shape[1]
    print(f"# {datetime.date.today()} model={a.model} rows={a.rows} real_tokens={real} (padded to the batch's "
          f"longest: {padded}) micro_batch={a.micro_batch} threads={torch.get_num_threads()}")
    from megarl.rl.grpo import grpo_loss_fn

    loss_fn = grpo_loss_fn(GRPOConfig(), num_tokens, old=None)  # ratio to this forward, detached

    def mcore(pack: bool):
        def run():
            tr.pack = pack
            tr.begin_step()
            tr.accumulate(batch, loss_fn)
        return run

    # Run against an older megarl (PYTHONPATH=an export of another commit): its trainer has no
    # packing and its update always takes the old-logprob forward; only its own variant is timed.
    legacy = "old_forward" not in inspect.signature(grpo_update).parameters
    sides = {"hf": lambda: hf_fwd_bwd(hf, batch, a.micro_batch, num_tokens), "mcore_packed": mcore(True),
             "mcore_padded": mcore(False)}
    if legacy:
        sides = {"hf": sides["hf"], "mcore_legacy": mcore(False)}
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for k, fn in sides.items():
            fn()  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"\n## {k}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile))
        return
    times = {k: [] for k in sides}
    for rep in range(0 if a.skip_fwd_bwd else a.reps + 1):  # round 0: warm-up
        for k, fn in sides.items():
            t = timed(fn)
            if rep:
                times[k].append(t)
    med = {k: summary(v) for k, v in times.items() if v}
    if med:
        print("\n| forward/backward (equal micro-batches) | wall ms / 1k real tokens (median, min) "
              "| CPU ms / 1k real tokens | HF / this: wall median, wall min, CPU |")
        print("|---|---|---|---|")
        h = med["hf"]
        for k, (wm, wn, c) in med.items():
            print(f"| {k} | {1e6 * wm / real:.1f}, {1e6 * wn / real:.1f} | {1e6 * c / real:.1f} "
                  f"| {h[0] / wm:.2f}x, {h[1] / wn:.2f}x, {h[2] / c:.2f}x |")
        print("per-round (wall, CPU) seconds:", {k: [(round(w, 3), round(c, 3)) for w, c in v] for k, v in times.items()})
    if a.skip_step:
        return

    budget = a.budget or 8 * real // a.rows
    spec = UpdateSpec(GRPOConfig(), 8, 1.0, 0)
    variants = {  # name: (old-logprob forward, packed, token budget)
        "before: old forward, padded": (True, False, 0),
        "old forward, packed": (True, True, 0),
        "no old forward, padded": (False, False, 0),
        "after: no old forward, packed": (False, True, 0),
        f"no old forward, packed, budget {budget} tokens": (False, True, budget),
    }
    keep = [int(i) for i in a.variants.split(",")]
    variants = {k: v for i, (k, v) in enumerate(variants.items()) if i in keep}
    if legacy:
        variants = {"legacy (this megarl's grpo_update)": (True, False, 0)}
    steps = {k: [] for k in variants}
    for rep in range(a.reps + 1):
        for k, (old, pack, tokens) in variants.items():
            tr.pack, tr.cfg.micro_batch_tokens = pack, tokens
            kw = {} if legacy else {"old_forward": old}
            t = timed(lambda: grpo_update(tr, groups, spec, **kw))
            if rep:
                steps[k].append(t)
    base = summary(next(iter(steps.values())))
    print("\n| GRPO step (grpo_update) | wall s / step (median, min) | CPU s / step | speedup over the first: "
          "wall median, wall min, CPU |")
    print("|---|---|---|---|")
    for k, v in steps.items():
        wm, wn, c = summary(v)
        print(f"| {k} | {wm:.3f}, {wn:.3f} | {c:.3f} | {base[0] / wm:.2f}x, {base[1] / wn:.2f}x, {base[2] / c:.2f}x |")
    print("per-round (wall, CPU) seconds:", {k: [(round(w, 3), round(c, 3)) for w, c in v] for k, v in steps.items()})


if __name__ == "__main__":
    main()
