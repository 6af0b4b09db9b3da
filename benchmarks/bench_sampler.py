"""Time of the engine's T=1 sampling step (``sampler.sample_keyed``) on a real model's logits: the
torch path against the fused C++ kernel (``megarl._keyed_gumbel``), alternated in one process, and
the tokens of both compared. The logits are SmolLM2's over a response it sampled at T=1 to a task
prompt (``--response-tokens`` positions: peaked and flat rows, as in a rollout), cycled to the batch
size with a distinct key per row.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sampler.py --model ~/.cache/megarl/models/smollm2
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from megarl.engine import sampler
from megarl.models.hf_io import load_hf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/megarl/models/smollm2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--response-tokens", type=int, default=64)
    args = ap.parse_args()
    if sampler._native is None:
        raise SystemExit(f"megarl._keyed_gumbel is not built ({sampler._NATIVE_ERROR}): run `make venv` "
                         "or `python setup.py build_ext --inplace`")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_hf_model(args.model, torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "Calculate 7 + 5."}], add_generation_prompt=True)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(args.response_tokens):  # a T=1 response (plain multinomial: only the rows matter)
            last = model.logits(model.hidden_states(torch.tensor([ids]))[0, -1:])
            ids.append(int(torch.multinomial(torch.softmax(last[0], -1), 1, generator=g)))
        logits = model.logits(model.hidden_states(torch.tensor([ids]))[0, -args.response_tokens - 1:-1])
    print(f"{'batch':>6} {'torch ms':>9} {'C++ ms':>8} {'ratio':>6}  same tokens")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        rows = logits[torch.arange(b) % logits.shape[0]].contiguous()
        key = [torch.arange(b), torch.zeros(b, dtype=torch.int64), torch.arange(b) % 97]
        times = {True: [], False: []}
        picked = {}
        for _ in range(args.repeats):
            for native in (False, True):  # alternated: the machine's drift hits both alike
                sampler.USE_NATIVE = native
                t0 = time.perf_counter()
                picked[native] = sampler.sample_keyed(rows, 1.0, 0, 1.0, 1234, 3, *key)
                times[native].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        print(f"{b:>6} {med[False]:>9.2f} {med[True]:>8.2f} {med[False] / med[True]:>6.1f}  "
              f"{torch.equal(picked[False], picked[True])}")
    sampler.USE_NATIVE = True


if __name__ == "__main__":
    main()
