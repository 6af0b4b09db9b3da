"""Time of the engine's T=1 sampling step (``sampler.sample_keyed``) on a real model's logits: the
torch path against the fused C++ kernel (``megarl._keyed_gumbel``) on its scalar path and, where the
CPU has it, its AVX-512 path, alternated in one process, and the tokens of all compared. The logits
are SmolLM2's over a response it sampled at T=1 (``--response-tokens`` positions) to a task prompt
(``--prompt chat``: peaked and flat rows, as in a rollout) or to 32 random tokens (``--prompt
random``: flat rows, most of the vocabulary in the race, as in ``megarl bench engine``), cycled to
the batch size with a distinct key per row.

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
    ap.add_argument("--prompt", choices=["chat", "random"], default="chat")
    args = ap.parse_args()
    if sampler._native is None:
        raise SystemExit(f"megarl._keyed_gumbel is not built ({sampler._NATIVE_ERROR}): run `make venv` "
                         "or `python setup.py build_ext --inplace`")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_hf_model(args.model, torch.float32)
    g = torch.Generator().manual_seed(0)
    if args.prompt == "chat":
        ids = list(tok.apply_chat_template([{"role": "user", "content": "Calculate 7 + 5."}],
                                           add_generation_prompt=True, return_dict=False))
    else:
        ids = torch.randint(0, model.args.vocab_size, (32,), generator=g).tolist()
    with torch.inference_mode():
        for _ in range(args.response_tokens):  # a T=1 response (plain multinomial: only the rows matter)
            last = model.logits(model.hidden_states(torch.tensor([ids]))[0, -1:])
            ids.append(int(torch.multinomial(torch.softmax(last[0], -1), 1, generator=g)))
        logits = model.logits(model.hidden_states(torch.tensor([ids]))[0, -args.response_tokens - 1:-1])
    paths = {"torch": (False, False), "scalar": (True, False)}  # (USE_NATIVE, NATIVE_VECTOR)
    if sampler._native.avx512:
        paths["avx512"] = (True, True)
    print(f"{'batch':>6} " + " ".join(f"{p + ' ms':>10}" for p in paths) + f" {'torch/scalar':>12}"
          + (f" {'scalar/avx512':>13}" if "avx512" in paths else "") + "  same tokens")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        rows = logits[torch.arange(b) % logits.shape[0]].contiguous()
        key = [torch.arange(b), torch.zeros(b, dtype=torch.int64), torch.arange(b) % 97]
        times = {p: [] for p in paths}
        picked = {}
        for _ in range(args.repeats):
            for p, (native, vector) in paths.items():  # alternated: the machine's drift hits all alike
                sampler.USE_NATIVE, sampler.NATIVE_VECTOR = native, vector
                t0 = time.perf_counter()
                picked[p] = sampler.sample_keyed(rows, 1.0, 0, 1.0, 1234, 3, *key)
                times[p].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        same = all(torch.equal(picked["torch"], t) for t in picked.values())
        print(f"{b:>6} " + " ".join(f"{med[p]:>10.2f}" for p in paths) + f" {med['torch'] / med['scalar']:>12.1f}"
              + (f" {med['scalar'] / med['avx512']:>13.1f}" if "avx512" in paths else "") + f"  {same}")
    sampler.USE_NATIVE, sampler.NATIVE_VECTOR = True, True


if __name__ == "__main__":
    main()
