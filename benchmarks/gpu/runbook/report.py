"""The GPU runbook's markdown report (``report.md``): every figure the parts wrote next to the
design's targets, and what each part did. Reads only the files under the out folder: a part's
figures are its JSONL file's result line; a part without one (cut at its limit, crashed, or
running when the command ended) shows as such, never as a met target, and the rows it finished
are listed under "Cut parts" with where it stopped."""
from __future__ import annotations

from pathlib import Path

from benchmarks.gpu.runbook.rows import read_rows

# The targets of the GPU work (docs/gpu/README.md, "Reading the report").
TARGETS = {
    "speedup_b64": 5.0,  # engine tok/s >= 5x transformers generate at batch 64
    "frac_bound_b1": 0.60,  # >= 60% of the memory-bandwidth bound at batch 1
    "verify_k4_b16": 1.3,  # verify K=4 at batch 16 <= 1.3x one decode step
    "mismatch_per_10k": 0.0,  # bf16 spec vs non-spec divergences per 10k tokens: goal 0
}


def _load(out_dir: Path, summary: dict, part: str) -> dict | None:
    """The part's result line, if it finished."""
    if part not in summary.get("parts", {}):
        return None
    try:
        return read_rows(out_dir / f"{part}.jsonl")[1]
    except OSError:
        return None


def _where(rec: dict) -> str:
    """Where a part that did not finish stopped, from its rows."""
    n = rec.get("rows") or 0
    if not n:
        return "no row finished"
    return f"{n} row{'s' if n > 1 else ''} finished, the last `{rec.get('last_row')}`"


def _row_text(row: dict) -> str:
    skip = {"row", "t_s", "tests", "output_tail", "versions", "imports", "device"}
    cells = []
    for k, v in row.items():
        if k in skip or isinstance(v, (dict, list)):
            continue
        cells.append(f"{k} {_fmt(v, '.4g') if isinstance(v, float) else v}")
    return ", ".join(cells)[:400]


def _cut_parts(summary: dict, out_dir: Path) -> list[str]:
    """The rows of every part that started but has no result line."""
    lines = []
    for name, rec in summary.get("parts", {}).items():
        if rec.get("status") == "skipped":
            continue
        rows, result = read_rows(out_dir / f"{name}.jsonl")
        if result is not None:
            continue
        state = ("still running when this report was written (if it is the last one, the command ended here)"
                 if rec.get("status") == "running" else f"{rec.get('status')}: {rec.get('error', '')}")
        lines += [f"### {name}: cut, {_where(rec)}", "", state[:400], ""]
        lines += [f"- `{r['row']}` at {r.get('t_s', 0):.1f} s: {_row_text(r)}" for r in rows[-40:]]
        if len(rows) > 40:
            lines.insert(len(lines) - 40, f"(the last 40 of {len(rows)} rows; all are in {name}.jsonl)")
        lines.append("")
    return lines


def _fmt(x, spec: str = ".3g") -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def _verdict(value, target: float, higher_is_better: bool, dry: bool) -> str:
    if value is None:
        return "not measured"
    met = value >= target if higher_is_better else value <= target
    return ("met" if met else "**not met**") + (" (dry run: not comparable)" if dry else "")


def _missing(summary: dict, part: str) -> str:
    rec = summary.get("parts", {}).get(part)
    if rec is None:
        return f"part `{part}` not run"
    return f"part `{part}` {rec.get('status')}: {rec.get('error', 'no figures written')}"


def _targets(summary: dict, env, engine, identity, grpo_spec, dry: bool) -> list[str]:
    rows = ["| target | measured | verdict |", "|---|---|---|"]
    copy = (env or {}).get("ceilings", {}).get("copy_gbps")
    if engine is None:
        rows.append(f"| engine >= {TARGETS['speedup_b64']:g}x generate at batch 64; >= {TARGETS['frac_bound_b1']:.0%} "
                    f"of the bound at batch 1; verify K=4 at batch 16 <= {TARGETS['verify_k4_b16']}x decode | — | "
                    f"not measured: {_missing(summary, 'engine')} |")
    else:
        kvs = engine["shape"]["kv_caches"]
        by_batch = {r["batch"]: r for r in engine["rows"]}
        for kv in kvs:
            r64 = by_batch.get(64)
            v = r64[kv]["speedup_vs_hf"] if r64 else None
            rows.append(f"| engine ({kv}) >= {TARGETS['speedup_b64']:g}x `generate` tok/s at batch 64 | "
                        f"{_fmt(v, '.2f') + 'x' if v is not None else 'no batch-64 row'} | "
                        f"{_verdict(v, TARGETS['speedup_b64'], True, dry)} |")
        for kv in kvs:
            r1 = by_batch.get(1)
            v = r1[kv]["frac_of_bound"] if r1 else None
            extra = ""
            if r1 and copy:  # the same bound at the measured copy bandwidth instead of the datasheet's
                extra = f"; {r1[kv]['engine_tok_s'] / (copy * 1e9 / r1['bytes_per_step']):.1%} of the bound at the " \
                        f"measured copy {copy:.0f} GB/s"
            rows.append(f"| engine ({kv}) >= {TARGETS['frac_bound_b1']:.0%} of the bandwidth bound at batch 1 | "
                        f"{_fmt(v, '.1%')} at {engine['shape']['hbm_gbps']:.0f} GB/s{extra} | "
                        f"{_verdict(v, TARGETS['frac_bound_b1'], True, dry)} |")
        for kv, v in engine["verify_k4_b16"].items():
            x = v["verify_over_decode"]
            rows.append(f"| verify K=4 at batch 16 ({kv}) <= {TARGETS['verify_k4_b16']}x one decode step | "
                        f"{_fmt(x, '.2f')}x ({v['verify_step_ms']:.2f} vs {v['decode_step_ms']:.2f} ms) | "
                        f"{_verdict(x, TARGETS['verify_k4_b16'], False, dry)} |")
    if identity is None:
        rows.append(f"| bf16 spec vs non-spec mismatch rate measured (goal 0) | — | not measured: "
                    f"{_missing(summary, 'identity')} |")
    else:
        for src, v in identity["per_source"].items():
            rate = v.get("per_10k")
            what = f"{_fmt(rate, '.2f')} per 10k ({v['diverged']} in {v['exposure_tokens']} tokens)"
            if v.get("error"):
                what += f"; error: {v['error'][:200]}"
            rows.append(f"| mismatch rate, source `{src}` (goal 0 per 10k) | {what} | "
                        f"{_verdict(rate, TARGETS['mismatch_per_10k'], False, dry)} |")
    cmp_ = (grpo_spec or {}).get("comparison")
    if cmp_ is None or "error" in cmp_:
        why = cmp_["error"] if cmp_ else _missing(summary, "grpo_spec")
        rows.append(f"| GRPO with speculation + bubble drafts: exact | — | not measured: {why} |")
    else:
        first = cmp_["first_step_with_difference"]
        rows.append(f"| GRPO with speculation + bubble drafts: exact (same tokens and weights every step) | "
                    f"{'exact' if cmp_['exact'] else f'differs from step {first}'} over {cmp_['steps_compared']} "
                    f"steps; rollout speedup (steps >= 2) {_fmt(cmp_['rollout_speedup_steps2plus'], '.2f')}x | "
                    f"{'met' if cmp_['exact'] else '**not met**'} |")
    return rows


def _engine_table(engine: dict) -> list[str]:
    kvs = engine["shape"]["kv_caches"]
    head = "| batch | generate tok/s | bound tok/s | " + " | ".join(
        f"{kv} tok/s | {kv} spec tok/s | {kv} x generate | {kv} of bound" for kv in kvs) + " |"
    rows = [head, "|" + "---|" * (3 + 4 * len(kvs))]
    for r in engine["rows"]:
        cells = [str(r["batch"]), f"{r['hf_tok_s']:.1f}", f"{r['bound_tok_s']:.0f}"]
        for kv in kvs:
            e = r[kv]
            cells += [f"{e['engine_tok_s']:.1f}", f"{e['engine_spec_tok_s']:.1f}", f"{e['speedup_vs_hf']:.2f}",
                      f"{e['frac_of_bound']:.1%}"]
        rows.append("| " + " | ".join(cells) + " |")
    graphs = engine.get("cuda_graphs", {})
    rows += ["", f"CUDA graphs: {graphs.get('status', '—')}" + (f" ({graphs['why']})" if graphs.get("why") else "")]
    return rows


def _grpo_section(name: str, g: dict) -> list[str]:
    s = g["summary_after_step1"]
    rows = [f"### {name}", "", f"layout: {g.get('layout')}; SFT {_fmt(g['sft'].get('sft_time_s'), '.1f')} s; "
            f"wall {g['wall_s']:.0f} s; peak GPU memory {_fmt(g.get('peak_gib'))} GiB; medians over steps >= 2: "
            f"step {_fmt(s['step_time_s_median'])} s, rollout "
            f"{_fmt(s['rollout_time_s_median'])} s ({s['rollout_tok_s']:.0f} tok/s), train "
            f"{_fmt(s['train_time_s_median'])} s, weight sync {_fmt(s['weight_sync_s_median'])} s "
            f"({_fmt(s['weight_sync_gbps_median'])} GB/s), bubble work {_fmt(s['bubble_time_s_median'])} s", "",
            "| step | step s | " + " | ".join(f"{p} s" for p in ("generate", "reward", "bubble", "train", "sync"))
            + " | rollout tokens | sync GB/s | reward | forward reduction | logprob_diff_max |", "|" + "---|" * 12]
    moved = sum(1 for st in g["steps"] if (st.get("grad_norm") or 0) > 0)
    if g.get("nondeterministic_ops"):
        rows.insert(3, f"**not bitwise repeatable**: ops without a deterministic CUDA kernel ran (warned instead "
                       f"of failing): `{'; '.join(g['nondeterministic_ops'])[:400]}`")
        rows.insert(3, "")
    rows.insert(3, "")
    rows.insert(4, f"policy updated (grad_norm > 0) in {moved} of {len(g['steps'])} steps"
                + ("" if moved else ": the weights never changed, so bubble drafts are exact copies and a "
                   "speculation speedup is the ceiling, not a realistic figure"))
    phases = {p["step"]: p for p in g["phases_s"]}
    for st in g["steps"]:
        ph = phases.get(st["step"], {})
        rows.append(f"| {st['step']} | {_fmt(st.get('step_time_s'))} | " + " | ".join(
            _fmt(ph.get(p)) for p in ("generate", "reward", "bubble", "train", "sync"))
            + f" | {st.get('rollout_tokens')} | {_fmt(st.get('weight_sync_gbps'))} | {_fmt(st.get('reward_mean'))} | "
              f"{_fmt(st.get('forward_reduction'))} | {_fmt(st.get('logprob_diff_max'))} |")
    return rows + [""]


def render(summary: dict, out_dir: Path) -> str:
    out_dir = Path(out_dir)
    dry = bool(summary.get("dry_run"))
    env, engine, identity = (_load(out_dir, summary, p) for p in ("env", "engine", "identity"))
    tests, grpo, grpo_spec = (_load(out_dir, summary, p) for p in ("pytest", "grpo", "grpo_spec"))
    dev = (env or {}).get("device", {})
    lines = ["# megarl GPU runbook report", ""]
    if dry:
        lines += ["**DRY RUN** on CPU with tiny shapes: it checks every part's code path; its figures are not "
                  "comparable with the targets.", ""]
    lines.append(f"device: {dev.get('name', '—')} ({dev.get('memory_gib', '—')} GiB, {dev.get('sm_count', '—')} SMs, "
                 f"nvidia-smi: {dev.get('nvidia_smi', '—')}); date {(env or {}).get('date_utc', '—')}")
    if env:
        v = env["versions"]
        lines.append("versions: " + ", ".join(f"{k} {v.get(k)}" for k in v) + f"; python {env['python']}")
        c, ar = env["ceilings"], env.get("allreduce", {})
        lines.append(f"ceilings: copy {_fmt(c.get('copy_gbps'), '.0f')} GB/s (read + write; datasheet "
                     f"{_fmt(dev.get('datasheet_gbps'))}), {c.get('matmul_dtype')} matmul "
                     f"{_fmt(c.get('matmul_tflops'), '.1f')} TFLOP/s (n={c.get('matmul_n')}); one-rank "
                     f"{ar.get('backend')} all-reduce {_fmt(ar.get('algbw_gbps'), '.0f')} GB/s, sum over one rank = input: "
                     f"{_fmt(ar.get('equal'))}" + (f" (error: {ar['error']})" if ar.get("error") else ""))
        lines.append(f"TORCHDYNAMO_DISABLE={env.get('torchdynamo_disable')} (1: Megatron's torch.compile'd fusions run "
                     f"eager)")
    for call in summary.get("commands", []):
        lines.append(f"command {call['dir']}: parts {', '.join(call['parts'])} on {call['device']} at "
                     f"{call['date_utc']}")
    if len({c["device"] for c in summary.get("commands", [])}) > 1:
        lines.append("**the commands ran on different devices**: compare figures only within one command")
    lines += ["", f"## Parts (profile {summary.get('profile', '—')})", "",
              "| part | status | seconds | limit s | rows | peak GPU GiB | error, or where it was cut |",
              "|---|---|---|---|---|---|---|"]
    for name, rec in summary.get("parts", {}).items():
        err = (rec.get("error") or "").replace("|", "/").replace("\n", " ")[:300]
        if rec["status"] not in ("ok", "skipped"):
            err = f"{err}; {_where(rec)}" if err else _where(rec)
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', 0):.1f} | {_fmt(rec.get('timeout_s'), '.0f')} | "
                     f"{rec.get('rows', 0)} | {_fmt(rec.get('peak_gib'))} | {err} |")
    not_started = [n for n in summary.get("parts_requested", []) if n not in summary.get("parts", {})]
    if not_started:
        lines.append(f"\nnot started (the command ended first, or still to come): {', '.join(not_started)}")
    cut = _cut_parts(summary, out_dir)
    if cut:
        lines += ["", "## Cut parts: the rows they finished", "", *cut]
    lines += ["", "## Targets", "", *_targets(summary, env, engine, identity, grpo_spec, dry), ""]
    lines += ["## gpu-marked tests", ""]
    if tests is None:
        lines.append(f"not run: {_missing(summary, 'pytest')}")
    else:
        c = tests["counts"]
        lines.append(f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
                     f"({tests['seconds']:.0f} s; files: {', '.join(tests['files'])})")
        lines += [f"- {t['outcome']}: `{t['test']}` {t['message'][:300]}" for t in tests["tests"]
                  if t["outcome"] in ("failed", "error")]
    lines += ["", "## Engine (Qwen2.5-1.5B shapes, random weights)", ""]
    if engine is None:
        lines.append(f"not measured: {_missing(summary, 'engine')}")
    else:
        s = engine["shape"]
        lines += [f"{s['dtype']}, prompt {s['prompt_len']}, {s['new_tokens']} new tokens, fastest of {s['repeats']}; "
                  f"bound at {s['hbm_gbps']:.0f} GB/s, weights {engine['weights_bytes'] / 1e9:.2f} GB; peak GPU "
                  f"memory {_fmt(engine.get('peak_gib'))} GiB", "",
                  *_engine_table(engine)]
    lines += ["", "## Token identity (speculation on vs off)", ""]
    if identity is None:
        lines.append(f"not measured: {_missing(summary, 'identity')}")
    else:
        lines += [f"{identity['requests']} requests, {identity['settings']['dtype']}, KV caches "
                  f"{', '.join(identity['kv'])}; divergences per 10k tokens (first differing token per response)",
                  "", "| source | diverged | tokens compared | per 10k |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['diverged']} | {v['exposure_tokens']} | {_fmt(v.get('per_10k'), '.2f')} |"
                  for k, v in identity["per_source"].items()]
        for kv, d in identity["kv"].items():
            lines.append(f"controls ({kv}): " + ", ".join(f"{k}: {c['diverged']} of {c['responses']} responses differ"
                                                          for k, c in d["controls"].items()))
    lines += ["", "## GRPO on one GPU (SmolLM2-135M body shapes, random init)", ""]
    for name, g in (("grpo: speculation off", grpo), ("grpo_spec: speculation + bubble drafts", grpo_spec)):
        part = name.split(":")[0]
        lines += _grpo_section(name, g) if g else [f"### {name}", "", f"not run: {_missing(summary, part)}", ""]
    return "\n".join(lines) + "\n"
