"""The step's weight sync goes into the engine the next round runs on (megarl/stages/step.py
RoundSync): tail batching's long rounds into their own engine (elastic rollout TP), if they have one."""
from megarl.stages.step import RoundSync


def test_the_sync_goes_to_the_next_rounds_engine():
    calls = []

    def sync_into(name):
        return lambda: calls.append(name) or {"engine": name}

    both = RoundSync(sync_into("short"), sync_into("long"))
    assert both(False) == {"engine": "short"} and both(True) == {"engine": "long"}
    assert RoundSync(sync_into("short"))(True) == {"engine": "short"}  # no engine of their own: the one
    assert calls == ["short", "long", "short"]
