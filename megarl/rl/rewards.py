"""Reward settings of a run and the rewards megarl ships (scored asynchronously, docs/design.md §3).

Rewards are scored while the rollout runs: each response goes to a :class:`RewardPool`
(megarl/rl/reward_pool.py) as soon as it finishes, so by the time a replica's last response is
out, most of its rewards are in. A reward that runs model-written code does so in a sandboxed
subprocess (megarl/rl/sandbox.py: time, memory and file-size limits, no network, a temporary
working directory); one that crashes or hangs scores 0 and is counted in ``reward_errors``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.rl.reward_pool import python_tests_reward, sandboxed
from megarl.rl.sandbox import SandboxLimits
from megarl.rl.task import Problem


@dataclass
class RewardConfig:
    """How responses are scored (the ``reward`` section)."""

    workers: int = 2
    """Threads scoring responses as they finish (a sandboxed reward runs one subprocess each)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of rewards that execute model-written code (``data.reward=python_tests``)."""
    allow_uncontained: bool = False
    """Run rewards that execute model-written code (``data.reward=python_tests``, HumanEval) on a
    machine where the sandbox cannot contain them (no working bubblewrap: megarl/rl/sandbox.py),
    with its limits and network isolation only. False: such a run refuses to start, saying why."""
    adaptive_timeout: bool = True
    """Shorten the sandbox's wall-clock limit to 3x the P95 run time of recent passing programs
    (never above ``sandbox.timeout_s``, never under 1 s): a batch of hanging programs then does
    not cost the full limit each."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"reward.workers={self.workers} is invalid; valid range: >= 1")


@sandboxed
def python_tests_problem_reward(problem: Problem, response_text: str, limits: SandboxLimits | None = None) -> float:
    """``data.reward=python_tests``: 1.0 if the response's program passes the problem's tests
    (the JSONL row's ``answer`` holds them: Python ``assert`` statements run after the
    program's last fenced code block), else 0.0; run in the sandbox."""
    return python_tests_reward(response_text, problem.answer, limits)
