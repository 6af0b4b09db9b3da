"""Procedural reasoning problems from ``reasoning_gym``, scored by each dataset's own verifier.

Problems: for each task of ``ReasoningGymConfig.tasks`` (in the listed order), ``size`` entries
of ``reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config[task])``. Problem
``uid = task_index * size + row_index``: contiguous from 0 and a pure function of the config, so
two loads with the same config give the same problems under the same uids (reasoning_gym
derives entry ``i`` from ``seed + i``). ``Problem.answer`` is the entry's reference answer.

Prompt: the entry's question, a blank line, then ``instruction`` (by default asking for the final
answer inside ``<answer>...</answer>``). Only the user-turn text: a chat template is applied by
the tokenizer side, not here.

Answer extraction, ``answer_format``:
- ``tag`` (default, ``extract_tagged_answer``): the text inside the LAST complete
  ``<answer>...</answer>`` pair, stripped. No tag pair, no answer: reward 0.0. There is no
  fallback to "the last line", which would reward format-free guessing.
- ``last_number`` (``extract_last_number``): the last number the response writes. For models
  too small to follow a tag format (SmolLM2-135M-Instruct writes the tag in ~4% of responses to
  an explicit request, measured) on tasks whose answer is one number; what GRPO then teaches is
  to end on the right number.

Reward (``ReasoningGymReward``): ``dataset.score_answer(extracted, entry)``. Scorers are
lenient in different ways (table below, measured with reasoning-gym 0.1.25 on crafted answers;
"ref" is the reference answer). ``binary=True`` (the default) maps a score to 1.0 only when the
scorer gives 1.0, else 0.0, so partial credit cannot be farmed::

  task              exact  wrong  ''   ' ref '  "The answer is ref."  ref+".0"  None  notes
  basic_arithmetic  1      0      0    0.5      0.21                  0.67      0     default scorer (*)
  leg_counting      1      0      0    0.43     0.17                  0.6       0     (*); '-ref' 0.75
  count_bits        1      0      0    0.33     0.12                  0.5       0     (*)
  letter_counting   1      0      0    0.2      0.06                  0.33      0     (*); '11' for 1: 0.5
  simple_equations  1      0      0    0.33     0.12                  0.5       0     (*)
  chain_sum         1      0      0    1        0.21                  1         0     Decimal equality, commas
                                                                                       stripped; else (*)
  gsm_symbolic      1      0.01   0    1        1                     1         0     FIRST number in the text;
                                                                                       sign dropped ('-ref' 1)
  number_sorting    1      0      0    1        0                     0 (**)    0     each value within +-1 of ref
                                                                                       scores 1 (tolerance 1)
  spell_backward    1      0.875  0    0.125    0                     1 (***)   0     per-position credit; case
                                                                                       ignored; 'ref'+'xyz' 0.8
  word_sorting      1      0.2    0    1        0.67                  1 (**)    0     ref + ', extra' scores 1;
                                                                                       any permutation >= 0.2

  (*)   ProceduralDataset.score_answer: exact string match, else len(ref)/len(answer) when ref is
        a substring of the answer: '17' earns 0.5 when ref is '7', '-7' 0.5, '7 or 8' 0.17.
  (**)  a list, so "formatted differently" is: number_sorting without brackets ('60.0, -19.7')
        0, as JSON numbers ('[60.0, -19.7]') 1; word_sorting without spaces ('a,b,c') 1.
  (***) a word, so upper-cased instead of '.0'.

Safe as binary verifiers (1.0 only for the right answer, modulo harmless formatting):
basic_arithmetic, leg_counting, count_bits, letter_counting, simple_equations (exact string),
chain_sum (numeric equality), spell_backward (case-insensitive). Still lenient after the binary
mapping, hence listed in ``LENIENT_AFTER_BINARY`` and warned about at load time: word_sorting
(extra trailing words still score 1.0), gsm_symbolic (only the first number counts, its sign is
dropped), number_sorting (values off by up to 1 score 1.0).
"""
from __future__ import annotations

import difflib
import logging
import math
import numbers
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.rl.task import Problem

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = ("Think it through, then give only your final answer inside <answer></answer> tags, "
                       "for example <answer>your answer</answer>.")
ANSWER_FORMATS = ("tag", "last_number")
LENIENT_AFTER_BINARY = {
    "word_sorting": "an answer with extra words appended to the right list scores 1.0",
    "gsm_symbolic": "only the first number of the answer counts and its sign is dropped",
    "number_sorting": "every value within 1 of the reference scores 1.0",
}
"""Tasks whose scorer gives 1.0 to some wrong answers, so ``binary`` does not make them strict."""


@dataclass
class ReasoningGymConfig:
    """Procedural reasoning problems from reasoning_gym (the ``data.reasoning_gym`` section)."""

    tasks: list[str] | str = field(default_factory=lambda: ["basic_arithmetic"])
    """reasoning_gym dataset names (``reasoning_gym.factory.DATASETS``), e.g. ["basic_arithmetic",
    "chain_sum"]; a single name is accepted. Their order fixes the uids."""
    size: int = 500
    """Problems per task; problem uid = task_index * size + row_index."""
    seed: int = 0
    """Seed handed to every task's dataset: same seed, same problems."""
    task_config: Any = None
    """Optional mapping task name -> dict of dataset options passed on to
    ``reasoning_gym.create_dataset`` (e.g. {"basic_arithmetic": {"max_terms": 3}}); every key
    must be one of ``tasks``. Typed ``Any`` because the config loader has no dict type."""
    answer_format: Literal["tag", "last_number"] = "tag"
    """Where the reward finds the answer: ``tag``, the text inside the last ``<answer>...</answer>``
    pair (no pair: reward 0); ``last_number``, the last number written in the response (for small
    models that do not follow a tag format yet, on tasks whose answer is a number; no number:
    reward 0)."""
    instruction: str | None = None
    """Text appended to each question (after a blank line). None: the answer format's default
    (``tag``: asks for the answer inside ``<answer></answer>`` tags; ``last_number``: nothing
    appended). With ``tag`` it must mention the ``<answer>`` tag: the reward reads only that."""
    binary: bool = True
    """Reward 1.0 only when the dataset's scorer gives 1.0, else 0.0. Several scorers give
    partial credit to wrong answers (0.01 for any number, len(ref)/len(answer) for an answer
    containing the reference); false passes the raw score in [0, 1] through."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        if not isinstance(self.tasks, (list, tuple)) or not self.tasks \
                or not all(isinstance(t, str) and t for t in self.tasks):
            raise ValueError(f"tasks={self.tasks!r} is invalid; valid: a non-empty list of reasoning_gym "
                             f"dataset names, e.g. ['basic_arithmetic']")
        self.tasks = list(self.tasks)
        dup = sorted(t for t, c in Counter(self.tasks).items() if c > 1)
        if dup:
            raise ValueError(f"tasks lists {dup} more than once; valid: each task once (raise size instead)")
        for name in ("size", "seed"):
            value = getattr(self, name)
            low = 1 if name == "size" else 0
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name}={value!r} is invalid; valid range: an integer >= {low}")
        if self.task_config is None:
            self.task_config = {}
        if not isinstance(self.task_config, dict):
            raise ValueError(f"task_config={self.task_config!r} is invalid; valid: a mapping task name -> "
                             f"dict of dataset options, e.g. {{'basic_arithmetic': {{'max_terms': 3}}}}")
        for task, kwargs in self.task_config.items():
            if task not in self.tasks:
                raise ValueError(f"task_config names {task!r}, which is not in tasks {self.tasks}; valid keys: "
                                 f"those tasks")
            if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                raise ValueError(f"task_config[{task!r}]={kwargs!r} is invalid; valid: a dict of dataset options")
            for reserved in ("size", "seed"):
                if reserved in kwargs:
                    raise ValueError(f"task_config[{task!r}] sets {reserved!r}; set the section's {reserved} "
                                     f"instead (it applies to every task)")
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={self.answer_format!r} is invalid; valid choices: {list(ANSWER_FORMATS)}")
        if self.instruction is None:
            self.instruction = DEFAULT_INSTRUCTION if self.answer_format == "tag" else ""
        if not isinstance(self.instruction, str) or (self.answer_format == "tag" and "<answer>" not in
                                                     self.instruction):
            raise ValueError(f"instruction={self.instruction!r} is invalid with answer_format=tag; valid: text that "
                             f"asks for the final answer inside <answer></answer> tags (the reward reads only those)")
        if not isinstance(self.binary, bool):
            raise ValueError(f"binary={self.binary!r} is invalid; valid: true or false")


_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*")


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (an optional sign, digits, decimal or thousands
    separators between digits: "-1,234.5"), thousands commas removed; None if there is none.
    A sentence's final period is not part of it ("is 49." gives "49")."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].lstrip("+")
    return number.replace(",", "") if "." in number or number.count(",") else number


def extract_tagged_answer(text: str, tag: str = "answer") -> str | None:
    """The text inside the last complete ``<tag>...</tag>`` pair of ``text``, stripped: the
    last closing tag and the nearest opening tag before it. None when there is no complete pair
    (no tags, or a response cut before its closing tag)."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    return text[start + len(open_tag):end].strip()


class ReasoningGymReward:
    """``reward_fn(problem, response_text) -> float`` for problems from ``load_reasoning_gym``.

    Holds, per uid, the dataset whose ``score_answer`` judges it and the entry it needs (the
    scorers compare with metadata, not only with ``Problem.answer``). Read-only after
    construction, so worker threads share it safely; nothing global."""

    def __init__(self, items: dict[int, tuple[str, Any, dict]], binary: bool = True,
                 answer_format: str = "tag") -> None:
        self._items = items
        self.binary = binary
        self.extract = extract_tagged_answer if answer_format == "tag" else extract_last_number
        self._lock = threading.Lock()
        self.scorer_errors: Counter = Counter()
        """Per task: scorer calls that raised (scored 0.0: an answer the verifier chokes on is wrong)."""

    def raw_score(self, problem: Problem, answer: str | None) -> float:
        """The dataset scorer's value for an already-extracted ``answer`` (None: no answer), in [0, 1]."""
        if problem.uid not in self._items:
            raise ValueError(f"problem uid {problem.uid} is not one of the {len(self._items)} problems this "
                             f"reward was built for (uids 0..{len(self._items) - 1})")
        if answer is None:
            return 0.0
        task, dataset, entry = self._items[problem.uid]
        try:
            score = float(dataset.score_answer(answer, entry))
        except Exception as e:   # noqa: BLE001 - the verifier's bug must not stop the run
            with self._lock:
                self.scorer_errors[task] += 1
            log.debug("reasoning_gym %s scorer raised %r on answer %r", task, e, answer[:200])
            return 0.0
        return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0

    def __call__(self, problem: Problem, response_text: str) -> float:
        score = self.raw_score(problem, self.extract(response_text))
        if self.binary:
            return 1.0 if score >= 1.0 else 0.0
        return score


def _create(task: str, cfg: ReasoningGymConfig):
    """``create_dataset`` for one task, turning reasoning_gym's TypeError/AssertionError into a
    ValueError that names the task and the offending option."""
    import dataclasses

    from reasoning_gym.factory import DATASETS, create_dataset

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3, cutoff=0.5)
        hint = f"did you mean {close}? " if close else ""
        raise ValueError(f"unknown reasoning_gym task {task!r}; {hint}registered tasks: {sorted(DATASETS)}")
    kwargs = cfg.task_config.get(task, {})
    valid = sorted(f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("size", "seed"))
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"task_config[{task!r}] has unknown option {key!r}{hint}; valid options: {valid}")

    def build(kw: dict):
        dataset = create_dataset(task, size=cfg.size, seed=cfg.seed, **kw)
        return dataset, [dataset[i] for i in range(cfg.size)]

    try:
        return build(kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        # Find the option(s) that fail on their own (on top of the defaults) to name them.
        bad = []
        for key, value in kwargs.items():
            try:
                create_dataset(task, size=1, seed=cfg.seed, **{key: value})
            except (TypeError, ValueError, AssertionError):
                bad.append(key)
        which = f"option(s) {bad}" if bad else f"the combination of options {sorted(kwargs)}"
        raise ValueError(f"task_config[{task!r}]: {which} rejected by reasoning_gym: "
                         f"{type(e).__name__}: {e}") from None


def load_reasoning_gym(cfg: ReasoningGymConfig) -> tuple[list[Problem], ReasoningGymReward]:
    """The problems of ``cfg`` (uid = task_index * size + row_index) and the reward that scores
    responses to them; see the module docstring. ValueError for an unknown task (naming it, with
    close matches and the registered names) or a task option reasoning_gym rejects."""
    problems: list[Problem] = []
    items: dict[int, tuple[str, Any, dict]] = {}
    for t, task in enumerate(cfg.tasks):
        dataset, entries = _create(task, cfg)
        if task in LENIENT_AFTER_BINARY:
            log.warning("reasoning_gym task %s: its scorer is lenient even with binary rewards: %s", task,
                        LENIENT_AFTER_BINARY[task])
        for i, entry in enumerate(entries):
            uid = t * cfg.size + i
            answer = entry.get("answer")
            question = str(entry["question"]).rstrip()
            prompt = f"{question}\n\n{cfg.instruction}" if cfg.instruction else question
            problems.append(Problem(uid=uid, prompt=prompt, answer="" if answer is None else str(answer)))
            items[uid] = (task, dataset, entry)
    return problems, ReasoningGymReward(items, binary=cfg.binary, answer_format=cfg.answer_format)


__all__ = ["ANSWER_FORMATS", "DEFAULT_INSTRUCTION", "extract_last_number", "LENIENT_AFTER_BINARY", "ReasoningGymConfig", "ReasoningGymReward",
           "extract_tagged_answer", "load_reasoning_gym"]
