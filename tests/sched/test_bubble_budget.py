"""The bubble budget (megarl/sched/bubble_budget.py): a unit of bubble work starts only if it is
expected to end before the rollout phase does, from measured bubble and unit lengths."""
from megarl.sched.bubble_budget import BubbleBudget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Phase:
    """``PhaseEnd.over`` stand-in: over once ``done``; records the ``also`` it was given."""

    def __init__(self):
        self.done, self.asked = False, []

    def over(self, also: bool = False) -> bool:
        self.asked.append(also)
        return self.done or also


def _bubble(budget, clock, phase, units: int, unit_s: float, kind="stream_train", bubble_s: float = 1.0) -> int:
    """One bubble of ``bubble_s`` seconds in which the work runs units of ``unit_s`` while allowed;
    returns how many it started (the drain loop of megarl/stream_train/stream.py)."""
    start = clock.t
    stop, started = budget.start(phase.over), 0
    phase.done = False
    while started < units and not stop(kind):
        started += 1
        clock.t += unit_s
        phase.done = clock.t - start >= bubble_s
    after = max(clock.t, start + bubble_s)
    clock.t = start + bubble_s  # the main thread's wait ends with the phase, maybe inside a unit
    budget.phase_over()
    clock.t = after
    stop(kind)  # the check after the last unit (it measures that unit)
    return started


def test_units_longer_than_the_bubble_stop_once_both_are_measured():
    clock, phase = Clock(), Phase()
    budget = BubbleBudget(clock)
    # First bubble: nothing measured, one unit runs (15 s in a 1 s bubble: the step waits for it).
    assert _bubble(budget, clock, phase, units=3, unit_s=15.0) == 1
    assert budget.bubble_s == 1.0 and budget.unit_s == {"stream_train": 15.0}
    # From then on a 15 s unit does not fit the bubbles this replica has: none starts.
    for _ in range(3):
        assert _bubble(budget, clock, phase, units=3, unit_s=15.0) == 0
    assert budget.bubble_s == 1.0


def test_units_that_fit_keep_running_and_other_kinds_are_judged_apart():
    clock, phase = Clock(), Phase()
    budget = BubbleBudget(clock)
    assert _bubble(budget, clock, phase, units=100, unit_s=0.125, bubble_s=1.0) == 8
    assert budget.unit_s["stream_train"] == 0.125 and budget.bubble_s == 1.0
    # A second bubble of the same length: units start while elapsed + 0.125 <= 1.0, all 8 of them.
    assert _bubble(budget, clock, phase, units=100, unit_s=0.125, bubble_s=1.0) == 8
    # Units that grew to 0.3 s: the moving average (0.125 -> 0.2125 -> 0.25625) lets fewer start.
    assert _bubble(budget, clock, phase, units=100, unit_s=0.3, bubble_s=1.0) == 3
    # A kind never measured may start (pre-generation after stream training, say).
    stop = budget.start(phase.over)
    phase.done = False
    assert stop("pregen") is False
    clock.t += 0.95
    assert stop("stream_train") is True  # 0.95 + the unit's estimate > 1.0: it would overrun
    assert stop() is False  # the phase itself is not over


def test_the_phase_end_is_asked_with_the_budget_decision():
    """The decision goes through PhaseEnd.over(also=...), which agrees it across a TP group."""
    clock, phase = Clock(), Phase()
    budget = BubbleBudget(clock)
    budget.bubble_s, budget.unit_s = 1.0, {"pregen": 2.0}
    stop = budget.start(phase.over)
    assert stop("pregen") is True and phase.asked[-1] is True
    assert stop("stream_train") is False and phase.asked[-1] is False


def test_a_replica_adopts_the_unit_lengths_the_others_measured():
    """Replica 1 never ran a unit (it was the slowest), then finishes first: with replica 0's unit
    length it does not start a 15 s unit in its ~0 s bubble."""
    clock, phase = Clock(), Phase()
    alone, budget = BubbleBudget(clock), BubbleBudget(clock)
    alone.bubble_s = budget.bubble_s = 0.2  # its bubbles so far: short; no unit measured
    assert _bubble(alone, clock, phase, units=3, unit_s=15.0, bubble_s=1.0) == 1  # without the others' figure
    budget.adopt([{"stream_train": 15.0, "pregen": 0.05}, {"stream_train": 13.0}])
    assert budget.unit_s == {"stream_train": 14.0, "pregen": 0.05}
    assert _bubble(budget, clock, phase, units=3, unit_s=15.0, bubble_s=1.0) == 0
    budget.adopt([{"stream_train": 99.0}])  # its own measurement stays
    assert budget.unit_s["stream_train"] == 14.0


def test_stream_units_timed_after_the_rollout_count_as_measurements():
    """Stream training trains its leftover groups after the rollout, one unit each: the policy
    records that time (megarl/sched/policy.py), so a replica knows the unit before its first bubble."""
    clock, phase = Clock(), Phase()
    budget = BubbleBudget(clock)
    budget.bubble_s = 1.0
    budget.record_unit("stream_train", 15.0)
    assert _bubble(budget, clock, phase, units=3, unit_s=15.0, bubble_s=1.0) == 0
    budget.record_unit("stream_train", 0.25)  # moving average: 7.625
    assert budget.unit_s["stream_train"] == 7.625


def test_the_policy_records_the_last_steps_time_per_group():
    from types import SimpleNamespace

    from megarl.sched.bubble import ScheduleConfig
    from megarl.sched.policy import BubblePolicy
    from megarl.spec.config import SpecConfig

    policy = BubblePolicy(ScheduleConfig(), SpecConfig(), stream_train=True, on_cpu=True, replicas=2)
    budget = BubbleBudget()
    step0, step1 = SimpleNamespace(groups=4, seconds=20.0), SimpleNamespace(groups=0, seconds=0.0)
    policy.bubble_plan([], budget, step0)
    assert budget.unit_s == {}  # nothing trained before step 0
    policy.bubble_plan([], budget, step1)
    assert budget.unit_s == {"stream_train": 5.0}
