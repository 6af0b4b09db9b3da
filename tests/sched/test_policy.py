"""The bubble policy composes a step's bubble units (megarl/sched/policy.py): the ones this run puts
into bubbles, in ``schedule.bubble_work``'s order; the bubble thread runs them in that order,
each asked to stop with its own kind (the bubble budget's unit length), the phase's end checked
before each (megarl/sched/bubble.py)."""
from megarl.sched.bubble import ScheduleConfig, run_units
from megarl.sched.bubble_budget import BubbleBudget
from megarl.sched.policy import BubblePolicy
from megarl.spec.config import SpecConfig


class Unit:
    def __init__(self, kind: str, log: list):
        self.kind, self.log = kind, log

    def run(self, stop) -> None:
        self.log.append((self.kind, stop()))


def _policy(work: tuple[str, ...], replicas: int = 2) -> BubblePolicy:
    return BubblePolicy(ScheduleConfig(bubble_work=work), SpecConfig(enabled=True, bubble_pregen=True),
                        stream_train=True, on_cpu=True, replicas=replicas)


def _units(log: list) -> list[Unit]:
    return [Unit("stream_train", log), Unit("pregen", log), Unit("drafter_train", log)]


def test_the_plan_is_the_units_for_bubbles_in_the_schedules_order():
    plan = _policy(("pregen", "stream_train")).bubble_plan(_units([]), BubbleBudget(), None)
    assert [u.kind for u in plan] == ["pregen", "stream_train"]  # no drafter configured: not in bubbles
    assert _policy(("stream_train",)).bubble_plan(_units([]), BubbleBudget(), None)[0].kind == "stream_train"
    assert _policy(("stream_train",)).bubble_plan([Unit("pregen", [])], BubbleBudget(), None) == []
    assert _policy(("stream_train", "pregen"), replicas=1).bubble_plan(_units([]), BubbleBudget(), None) == []


def test_units_run_in_order_each_stopped_by_its_kind():
    log, asked = [], []

    def stop(kind=None):
        asked.append(kind)
        return False

    plan = _policy(("pregen", "stream_train")).bubble_plan(_units(log), BubbleBudget(), None)
    assert run_units(plan, stop) == {}
    assert log == [("pregen", False), ("stream_train", False)]
    assert asked == [None, "pregen", None, "stream_train"]


def test_the_phase_end_stops_the_work_before_the_next_unit():
    log, phase_checks = [], []

    def stop(kind=None):
        if kind is None:
            phase_checks.append(1)
            return len(phase_checks) > 1  # over once the first unit is done
        return False

    run_units(_policy(("stream_train", "pregen")).bubble_plan(_units(log), BubbleBudget(), None), stop)
    assert [k for k, _ in log] == ["stream_train"]
