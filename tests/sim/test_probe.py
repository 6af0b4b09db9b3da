"""megarl/sim/probe.py: the speed probe's ratio arithmetic and its errors."""
import pytest

from megarl.sim.probe import SpeedProbe, SpeedReference, alternate, speed_ratio


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


def _ref(median, what="decode probe: 64 requests x 64 tokens, 2 layers x 64 hidden, vocab 27"):
    return {"what": what, "samples_s": [[median]], "median_s": median}


def test_speed_ratio_is_run_over_calibration_and_refuses_other_work():
    assert speed_ratio(_ref(0.3), _ref(0.25)) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="timed different work"):
        speed_ratio(_ref(0.3), _ref(0.25, what="decode probe: 64 requests x 64 tokens, 3 layers x 128 hidden"))
    with pytest.raises(ValueError, match="speed reference of the calibration is invalid"):
        speed_ratio(_ref(0.3), {"median_s": 0.25})
    with pytest.raises(ValueError, match="speed reference of the run is invalid"):
        speed_ratio(_ref(0.0), _ref(0.25))


def test_speed_reference_times_the_default_model_whatever_the_config():
    # The reference is one fixed piece of work (the default model's decode probe), so that a bench run of
    # any config and a calibration compare; its record keeps every sample and their median.
    with SpeedReference(samples=3) as ref:
        before, after = ref.sample(), ref.sample()
        rec = ref.record(before, after)
    assert len(before) == len(after) == 3 and all(x > 0 for x in before + after)
    assert rec["samples_s"] == [before, after]
    six = sorted(before + after)
    assert rec["median_s"] == pytest.approx((six[2] + six[3]) / 2, abs=1e-5)
    assert rec["what"].startswith("decode probe: 64 requests x 64 tokens, 2 layers x 64 hidden")
    with pytest.raises(ValueError, match="samples=0 is invalid"):
        SpeedReference(samples=0)
