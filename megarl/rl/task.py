"""Synthetic long-tail reasoning task: multi-term addition with the working written out.

Prompt: the terms joined by ``+`` and closed by ``=``, e.g. ``"12+7+40="``.
Response (before EOS): one or more steps, each ``a+b=c`` followed by a separator, then the
answer marker ``#`` and the final sum, e.g. ``"12+7=19;19+40=59;#59"`` or
``"40+12=52|7+52=59,#59"``. Grammar::

    response := (INT "+" INT "=" INT SEP)+ "#" INT        SEP in SEPARATORS

Why this task: the number of terms follows a truncated power law, so most prompts need 1-3 steps
but a few need 20+, giving the long tail of response lengths (median ~24 tokens, max ~250) that
megarl's schedulers and speculative decoding exist for. Each step is ~9-11 tokens.

Why several solution styles: speculative decoding is only interesting when the policy is not
deterministic. The *ideal* policy (the distribution ``solution`` samples from) chooses per
solution an accumulation strategy, per step which terms to combine and in which order, and per
step a separator; ``estimate_entropy`` measures its mean per-token entropy exactly (Monte Carlo
over ``-log p(response)`` with ``solution_logprob`` summing over every derivation of a text):
about 0.33 nats/token pooled over tokens with the default config (0.25 averaged per
prompt: two-term prompts have only ~2.3 nats in ~12 tokens).

Strategies (chosen per solution with ``TaskConfig.strategy_weights``):
- ``left_to_right``: accumulate the terms in prompt order.
- ``any_next``: start from a random term, then add any remaining term next.
- ``pairwise``: combine any two pending values (terms or partial sums): tree-shaped grouping.
Within each step the two operands are written in random order.

Reward: 1.0 when the text after the last ``#`` (whitespace stripped) is exactly the correct sum,
0.0 otherwise. The working is not graded (``check_working`` validates it for tests and analysis):
a binary outcome reward is what GRPO reference setups use, and it keeps the reward exact and cheap
enough to compute as each response finishes.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

ANSWER_MARKER = "#"
SEPARATORS = (";", ",", " ", "\n", "|")
STRATEGIES = ("left_to_right", "any_next", "pairwise")
STRATEGY_WEIGHTS = (0.25, 0.25, 0.5)

_PROMPT_RE = re.compile(r"(\d+)(?:\+(\d+))+=")
_STEP_RE = re.compile(r"(\d+)\+(\d+)=(\d+)([" + re.escape("".join(SEPARATORS)) + r"])")


def _derived_seed(*parts: object) -> int:
    """A 64-bit seed from a tuple of values, stable across processes and Python versions
    (``hash()`` of strings is salted per process, so it must not be used for this)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass
class TaskConfig:
    """Configuration of the synthetic addition task."""

    num_prompts: int = 512
    """Size of the train set: uids ``0 .. num_prompts-1``. Larger uids are held-out problems."""
    seed: int = 0
    """Seed of the problem set and of the epoch orders; problem ``uid`` depends only on (seed, uid)."""
    min_terms: int = 2
    """Fewest terms in a prompt (at least 2: a one-term sum has no working)."""
    max_terms: int = 24
    """Most terms in a prompt; the response length grows ~10 tokens per term."""
    tail_alpha: float = 1.5
    """Heavy-tail shape: P(k terms) is proportional to (k - min_terms + 1) ** -tail_alpha.
    Smaller means a heavier tail; 1.5 gives ~45% two-term prompts and ~2.4% with 20 or more."""
    max_operand: int = 99
    """Terms are drawn uniformly from 1..max_operand (99: mostly two-digit operands)."""
    strategy_weights: tuple[float, float, float] = STRATEGY_WEIGHTS
    """Probabilities of the solution strategies (left_to_right, any_next, pairwise). A tiny model
    learns left_to_right quickly; the other two need it to track which terms are used."""

    def __post_init__(self) -> None:
        import math

        from megarl.utils.dataclass_config import check_number

        check_number("task.num_prompts", self.num_prompts, ge=1, integer=True)
        check_number("task.seed", self.seed, ge=0, integer=True)
        check_number("task.min_terms", self.min_terms, ge=2, integer=True, note="a one-term sum has no working")
        check_number("task.max_terms", self.max_terms, ge=self.min_terms, integer=True, note="at least task.min_terms")
        check_number("task.tail_alpha", self.tail_alpha, gt=0)
        check_number("task.max_operand", self.max_operand, ge=1, integer=True)
        if len(self.strategy_weights) != len(STRATEGIES) or not all(math.isfinite(w) for w in self.strategy_weights) \
                or min(self.strategy_weights) < 0 or sum(self.strategy_weights) <= 0:
            raise ValueError(f"task.strategy_weights={self.strategy_weights} must be {len(STRATEGIES)} non-negative "
                             f"weights, not all 0, for {STRATEGIES}")
        self.strategy_weights = tuple(float(w) / sum(self.strategy_weights) for w in self.strategy_weights)


@dataclass(frozen=True)
class Problem:
    """One prompt of a dataset; ``uid`` keys the sampling noise and the response history."""

    uid: int
    """Stable id of the prompt (train set: 0..num_prompts-1; JSONL sets: the line index)."""
    prompt: str
    """The prompt text exactly as fed to the tokenizer."""
    answer: str
    """The reference final answer, compared verbatim with the text after the answer marker."""


def parse_prompt(prompt: str) -> list[int]:
    """Terms of an addition prompt ``"a+b+...="``; ValueError for anything else."""
    if not _PROMPT_RE.fullmatch(prompt):
        raise ValueError(f"not an addition prompt: {prompt!r}; expected terms joined by '+' and ending "
                         f"with '=', e.g. '12+7+40='")
    return [int(t) for t in prompt[:-1].split("+")]


def parse_solution(text: str) -> tuple[list[tuple[int, int, int]], list[str], str]:
    """Split a response into its steps ``(a, b, c)``, the separator after each step and the final
    answer string; ValueError naming the position where the grammar breaks."""
    steps, seps, pos = [], [], 0
    while pos < len(text) and text[pos] != ANSWER_MARKER:
        m = _STEP_RE.match(text, pos)
        if m is None:
            raise ValueError(f"malformed step at position {pos} of {text!r}; expected 'a+b=c' followed by one "
                             f"of the separators {list(SEPARATORS)}")
        steps.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
        seps.append(m.group(4))
        pos = m.end()
    if not steps or pos >= len(text):
        raise ValueError(f"response {text!r} needs at least one step and the answer marker {ANSWER_MARKER!r}")
    final = text[pos + 1:]
    if not final.isdigit():
        raise ValueError(f"final answer {final!r} of {text!r} is not a non-negative integer")
    return steps, seps, final


def check_working(problem: Problem, text: str) -> None:
    """ValueError unless ``text`` parses, every step adds correctly, every step's operands are
    pending values (terms or earlier partial sums, each used once), all values are combined into
    one, and the final answer is that value and the reference answer."""
    steps, _, final = parse_solution(text)
    pool = Counter(parse_prompt(problem.prompt))
    for i, (a, b, c) in enumerate(steps):
        if a + b != c:
            raise ValueError(f"step {i} of {text!r}: {a}+{b} is {a + b}, not {c}")
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0:
            raise ValueError(f"step {i} of {text!r}: {a}+{b} uses a value that is not pending")
        pool[c] += 1
    pending = sorted(pool.elements())
    if len(pending) != 1:
        raise ValueError(f"{text!r} leaves {len(pending)} values uncombined: {pending}")
    if final != str(pending[0]) or final != problem.answer:
        raise ValueError(f"{text!r}: final answer {final} != combined value {pending[0]} / answer {problem.answer}")


def answer_reward(problem: Problem, response_text: str) -> float:
    """1.0 if the text after the last answer marker, stripped, equals ``problem.answer``; else 0.0.
    A response without the marker (e.g. truncated at the length limit) gets 0.0."""
    if ANSWER_MARKER not in response_text:
        return 0.0
    return 1.0 if response_text.rsplit(ANSWER_MARKER, 1)[1].strip() == problem.answer else 0.0


class AdditionTask:
    """The synthetic task: deterministic problems, an ideal-policy sampler, reward, epoch orders."""

    name = "addition"

    def __init__(self, cfg: TaskConfig | None = None) -> None:
        self.cfg = cfg or TaskConfig()
        ks = list(range(self.cfg.min_terms, self.cfg.max_terms + 1))
        weights = [(k - self.cfg.min_terms + 1) ** -self.cfg.tail_alpha for k in ks]
        total = sum(weights)
        self.num_terms_probs: dict[int, float] = {k: w / total for k, w in zip(ks, weights)}
        self._ks, self._cum = ks, list(_accumulate(weights))

    def __len__(self) -> int:
        return self.cfg.num_prompts

    def problem(self, uid: int) -> Problem:
        """Problem ``uid``: a pure function of (seed, uid). Any uid >= 0 is valid; uids at or
        beyond ``num_prompts`` are held out from training (see ``eval_uids``)."""
        if isinstance(uid, bool) or not isinstance(uid, numbers.Integral) or uid < 0:
            raise ValueError(f"uid must be a non-negative int, got {uid!r}")
        uid = int(uid)
        rng = random.Random(_derived_seed("addition-problem", self.cfg.seed, uid))
        k = rng.choices(self._ks, cum_weights=self._cum)[0]
        terms = [rng.randint(1, self.cfg.max_operand) for _ in range(k)]
        return Problem(uid=uid, prompt="+".join(map(str, terms)) + "=", answer=str(sum(terms)))

    def problems(self) -> list[Problem]:
        return [self.problem(u) for u in range(len(self))]

    def eval_uids(self, n: int) -> list[int]:
        """``n`` held-out uids (never in the train set), for evaluation."""
        return list(range(len(self), len(self) + n))

    def reward(self, problem: Problem, response_text: str) -> float:
        return answer_reward(problem, response_text)

    def solution(self, problem: Problem, rng: random.Random) -> str:
        """Sample a worked solution (without EOS) from the ideal policy; see the module docstring."""
        terms = parse_prompt(problem.prompt)
        strategy = rng.choices(STRATEGIES, weights=self.cfg.strategy_weights)[0]
        steps: list[tuple[int, int]] = []
        if strategy == "pairwise":
            pool = list(terms)
            while len(pool) > 1:
                i, j = rng.sample(range(len(pool)), 2)  # ordered: also picks the operand order
                a, b = pool[i], pool[j]
                for idx in sorted((i, j), reverse=True):
                    pool.pop(idx)
                pool.append(a + b)
                steps.append((a, b))
        else:
            rest = list(terms)
            acc = rest.pop(0 if strategy == "left_to_right" else rng.randrange(len(rest)))
            while rest:
                x = rest.pop(0 if strategy == "left_to_right" else rng.randrange(len(rest)))
                a, b = (acc, x) if rng.random() < 0.5 else (x, acc)
                steps.append((a, b))
                acc = a + b
        parts = [f"{a}+{b}={a + b}{rng.choice(SEPARATORS)}" for a, b in steps]
        return "".join(parts) + ANSWER_MARKER + str(sum(terms))

    def solution_logprob(self, problem: Problem, text: str) -> float:
        """Exact log-probability that ``solution`` returns ``text``, summed over every derivation
        (strategy, operand picks) that writes it; -inf for texts it never writes."""
        try:
            steps, seps, final = parse_solution(text)
            check_working(problem, text)
        except ValueError:
            return -math.inf
        terms = parse_prompt(problem.prompt)
        pair_steps = [(a, b) for a, b, _ in steps]
        p = 0.0
        for strategy, w in zip(STRATEGIES, self.cfg.strategy_weights):
            if strategy == "pairwise":
                p += w * _prob_pairwise(terms, pair_steps)
            else:
                p += w * _prob_accumulate(terms, pair_steps, strategy == "left_to_right")
        if p == 0.0:
            return -math.inf
        return math.log(p) + len(seps) * math.log(1.0 / len(SEPARATORS))


def _accumulate(xs: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for x in xs:
        total += x
        yield total


def _prob_pairwise(terms: Sequence[int], steps: Sequence[tuple[int, int]]) -> float:
    # The sampler picks an ordered pair of distinct positions uniformly, so the chance of writing
    # values (a, b) is (#ordered position pairs holding them) / (k (k-1)): only the multiset of
    # pending values matters.
    pool, k, p = Counter(terms), len(terms), 1.0
    for a, b in steps:
        pairs = pool[a] * (pool[b] - (a == b))
        if pairs <= 0:
            return 0.0
        p *= pairs / (k * (k - 1))
        pool[a] -= 1
        pool[b] -= 1
        pool[a + b] += 1
        k -= 1
    return p


def _prob_accumulate(terms: Sequence[int], steps: Sequence[tuple[int, int]], in_order: bool) -> float:
    # Sum over the first accumulator value (fixed for left_to_right); then each step must pair the
    # accumulator with a remaining term x: probability (copies of x)/(remaining) for any_next, and
    # 1/2 for the operand order unless both operands are equal (both orders write the same text).
    starts = [(terms[0], 1.0)] if in_order else [(v, c / len(terms)) for v, c in Counter(terms).items()]
    total = 0.0
    for first, p in starts:
        rest = list(terms)
        rest.remove(first)
        acc = first
        for a, b in steps:
            if a != acc and b != acc:
                p = 0.0
                break
            x = b if a == acc else a
            if in_order:
                if rest[0] != x:
                    p = 0.0
                    break
                rest.pop(0)
            else:
                if x not in rest:
                    p = 0.0
                    break
                p *= rest.count(x) / len(rest)
                rest.remove(x)
            p *= 1.0 if a == b else 0.5
            acc = a + b
        total += p
    return total


@dataclass
class EntropyEstimate:
    """Mean per-token entropy of the ideal policy over response tokens (EOS included)."""

    nats_per_token: float
    """Token-pooled mean: sum over prompts of H(response | prompt) / sum of expected lengths
    (by the chain rule this is the average next-token entropy over all response tokens)."""
    per_prompt_mean: float
    """Unweighted mean over prompts of H(response | prompt) / E[length]."""
    mean_tokens: float
    """Mean response length in tokens (characters + EOS)."""
    num_samples: int
    """Sampled responses behind the estimate."""


def estimate_entropy(task: AdditionTask, uids: Sequence[int], samples_per_prompt: int = 8,
                     seed: int = 0) -> EntropyEstimate:
    """Monte Carlo estimate of the ideal policy's entropy: H(Y|x) = E[-log p(Y|x)] with the exact
    ``solution_logprob``; lengths count one token per character plus EOS (CharTokenizer)."""
    rng = random.Random(seed)
    tot_h = tot_len = 0.0
    ratios = []
    for uid in uids:
        prob = task.problem(uid)
        h = n = 0.0
        for _ in range(samples_per_prompt):
            text = task.solution(prob, rng)
            h -= task.solution_logprob(prob, text)
            n += len(text) + 1
        tot_h += h
        tot_len += n
        ratios.append(h / n)
    return EntropyEstimate(nats_per_token=tot_h / tot_len, per_prompt_mean=sum(ratios) / len(ratios),
                           mean_tokens=tot_len / (len(uids) * samples_per_prompt),
                           num_samples=len(uids) * samples_per_prompt)
