"""megarl/sim/probe.py: the speed probe's ratio arithmetic and its errors."""
import pytest

from megarl.sim.probe import SpeedProbe, alternate


class _Fake:
    """A probe whose figures are given: the machine's speed as a list of times."""

    def __init__(self, times):
        self.times = list(times)

    def measure(self):
        return self.times.pop(0)


def test_alternate_divides_by_the_neighbouring_base_probes():
    # The machine slows down 2x over the measurement; the other probe costs 1.2x the base one
    # at every moment: the ratio must come out 1.2, not the drift.
    base = _Fake([1.0, 1.5, 2.0])
    other = _Fake([1.2 * 1.25, 1.2 * 1.75])
    ratio, b, o = alternate(base, other, 2)
    assert ratio == pytest.approx(1.2)
    assert b == [1.0, 1.5, 2.0] and len(o) == 2


def test_bad_probe_arguments_name_what_is_valid():
    with pytest.raises(ValueError, match="valid range: >= 1"):
        SpeedProbe("configs/tiny.yaml", 0)
    with pytest.raises(ValueError, match="valid: \\['decode', 'train'\\]"):
        SpeedProbe("configs/tiny.yaml", 1, kind="prefill")


def test_a_worker_that_dies_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="a worker exited"):
        SpeedProbe(str(tmp_path / "missing.yaml"), 1)
