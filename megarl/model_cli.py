"""``megarl`` commands on a model folder: ``generate`` (sample from it with megarl's engine) and
``eval`` (the ``eval`` section's held-out evaluation of it: megarl/stages/evaluate.py)."""
from __future__ import annotations

import dataclasses
import json
import sys

from megarl.utils.fs import atomic_write_text


def add_model_parsers(sub, add_config_args) -> None:
    """The ``generate`` and ``eval`` subcommands (``add_config_args``: the CLI's --config / --set)."""
    p = sub.add_parser("generate", help="sample from a HF model folder with megarl's engine")
    p.add_argument("--model", required=True, help="HF model folder (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text, repeatable (a user turn of the model's chat template, if it has one)")
    p.add_argument("--system", help="system message (with a chat template; default: the template's own)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as plain text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", help="learned drafter folder (RUN_DIR/hf/drafter): speculative decoding with it "
                                     "(same tokens, fewer target forwards; figures on stderr)")
    p.add_argument("--draft-k", type=int, default=4, help="draft length of the drafter's chain (with --drafter)")
    p = sub.add_parser("eval", help="the held-out evaluation of a HF model folder (e.g. RUN_DIR/hf): the "
                                     "metrics a run logs under eval/, as JSON on stdout")
    p.add_argument("--model", required=True, help="HF model folder (config.json, model.safetensors; its tokenizer "
                                                  "unless data.tokenizer_path is set)")
    add_config_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the metrics to PATH (JSON)")


def run_model_command(args) -> int:
    if args.command == "generate":
        _generate(args)
        return 0
    return _eval(args)


def _eval(args) -> int:
    """``megarl eval``: the run config's held-out set on ``--model``'s weights, sampled as the run
    samples it (same seed, noise, engine settings and batch order), so the final export's figures
    equal the run's last in-run evaluation."""
    from megarl.config import load_config
    from megarl.engine import Engine
    from megarl.models.hf_io import load_hf_model
    from megarl.parallel.layout import ParallelConfig
    from megarl.setup_run import prepare_inputs
    from megarl.stages.evaluate import Evaluator
    from megarl.rl.eval_metrics import eval_line

    cfg = load_config(args.config, args.overrides)
    if not cfg.eval.prompts:
        raise ValueError("megarl eval needs a held-out set: set eval.prompts >= 1 (in --config or with --set "
                         "eval.prompts=N)")
    # The model is --model's, on one process: a sample does not depend on the rollout layout (in
    # float64 exactly; in fp32/bf16 rollout TP's reductions may round differently, docs/design.md §1.1).
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from_hf=args.model, init_from_mcore=None),
                              parallel=ParallelConfig())
    inputs = prepare_inputs(cfg)
    engine_cfg = cfg.rollout.engine_config(inputs.max_seq_len)
    engine = Engine(load_hf_model(args.model, engine_cfg.torch_dtype), engine_cfg, seed=cfg.seed)
    metrics = Evaluator(cfg.eval, engine, inputs.held_out, inputs.reward_fn, inputs.tokenizer, cfg.rollout,
                        cfg.reward).run()
    print(eval_line(args.model, metrics), file=sys.stderr)
    text = json.dumps(metrics, indent=2)
    if args.json:
        atomic_write_text(args.json, text + "\n")
    print(text)
    return 0


def _generate(args) -> None:
    import torch

    from megarl.engine import Engine, EngineConfig, Request, SamplingParams
    from megarl.models.hf_io import load_hf_model
    from megarl.rl.tokenizer import HFTokenizer

    model = load_hf_model(args.model, torch.float32)
    tok = HFTokenizer(args.model, chat_template=False if args.no_chat_template else None, system_prompt=args.system)
    spec = None
    if args.drafter:
        from megarl.spec.config import DrafterConfig, SpecConfig
        from megarl.spec.speculator import Speculator

        if args.draft_k < 1:
            raise ValueError(f"--draft-k={args.draft_k} is invalid; valid range: >= 1")
        spec = Speculator(SpecConfig(enabled=True, sources=(), forward_cost_tokens=0, drafter=DrafterConfig(
            enabled=True, init_from=args.drafter, strategy="drafter", k=args.draft_k)))
    prompts = [tok.encode_prompt(p) for p in args.prompt]
    max_len = min(model.args.max_position_embeddings, max(map(len, prompts)) + args.max_new_tokens)
    engine = Engine(model, EngineConfig(max_batch_size=len(args.prompt), max_seq_len=max_len,
                                        dtype="float32", device="cpu"), seed=args.seed, spec=spec)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=tok.stop_ids)
    reqs = [Request(uid=i, sample_idx=0, prompt_ids=p, params=params) for i, p in enumerate(prompts)]
    results = engine.generate(reqs, step=0)
    for prompt, res in zip(args.prompt, results):
        # with a chat template the prompt is a user turn: show the answer on its own
        print(tok.decode(res.tokens) if tok.uses_chat_template else f"{prompt}{tok.decode(res.tokens)}")
    if spec is not None:
        m, n = spec.metrics(), sum(len(r.tokens) for r in results)
        print(f"drafter: {n} tokens in {sum(r.n_forwards for r in results)} target forwards, "
              f"{m.get('spec/accept_len_mean', 0.0):.2f} tokens per drafted forward", file=sys.stderr)
