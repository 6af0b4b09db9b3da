import functools
import threading
import time

import pytest

from megarl.rl.reward_pool import (RewardPool, adaptive_timeout, extract_program, is_sandboxed, p95,
                                   python_tests_reward, sandboxed)
from megarl.rl.sandbox import SandboxLimits, run_python

GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
HANGING = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"


def test_raising_reward_gives_zero_and_is_counted():
    def boom(x):
        raise KeyError(x)

    with RewardPool(2) as pool:
        assert pool.submit(boom, "k").result() == 0.0
        assert pool.submit(lambda: (_ for _ in ()).throw(SystemExit(1))).result() == 0.0
        assert pool.submit(lambda x, y=0: x + y, 2, y=0.5).result() == 2.5
        assert pool.submit(lambda: True).result() == 1.0
        assert pool.submit(lambda: float("nan")).result() == 0.0
        assert pool.submit(lambda: "not a number").result() == 0.0
        stats = pool.stats()
    assert stats["submitted"] == stats["completed"] == 6
    assert stats["ok"] == 2
    assert stats["errors"] == {"exception:KeyError": 1, "exception:SystemExit": 1, "non_finite": 1,
                               "exception:ValueError": 1}
    assert stats["error_total"] == 4


def test_python_tests_reward_and_pool_keeps_working():
    limits = SandboxLimits(timeout_s=1.0)
    with RewardPool(2, limits, adaptive=False) as pool:
        assert pool.submit(python_tests_reward, GOOD, TESTS).result() == 1.0
        assert pool.submit(python_tests_reward, WRONG, TESTS).result() == 0.0
        t0 = time.monotonic()
        assert pool.submit(python_tests_reward, HANGING, TESTS).result() == 0.0
        assert time.monotonic() - t0 < 3.0
        assert pool.submit(python_tests_reward, "```python\nx = bytearray(10 * 1024**3)\n```", "").result() == 0.0
        assert pool.submit(python_tests_reward, GOOD, TESTS).result() == 1.0   # still working
        stats = pool.stats()
    assert stats["ok"] == 3                       # a wrong answer is a 0 reward, not an error
    assert stats["errors"] == {"timeout": 1, "memory": 1}
    assert stats["sandbox_runs"] == {"ok": 2, "error": 1, "timeout": 1, "memory": 1}
    assert stats["timeout_s"] == 1.0              # not adaptive


def test_python_tests_reward_rejects_exiting_before_the_tests():
    hack = "```python\nimport os\ndef add(a, b):\n    return 0\nos._exit(0)\n```"
    assert python_tests_reward(hack, TESTS) == 0.0
    hack = "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```"
    assert python_tests_reward(hack, TESTS) == 0.0
    assert python_tests_reward(GOOD, TESTS) == 1.0     # callable outside a pool


def test_extract_program():
    assert extract_program("no fences\nx = 1") == "no fences\nx = 1"
    two = "```python\na = 1\n```\ntext\n```py\nb = 2\n```\n```\nplain\n```"
    assert extract_program(two) == "b = 2\n"           # last python block wins over a later bare one
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("```Python3 title\nd = 4\n```") == "d = 4\n"
    assert extract_program("```python\ne = 5\nf = 6") == "e = 5\nf = 6"   # cut off: open fence
    assert extract_program("```bash\nls\n```") == "```bash\nls\n```"


def test_sandboxed_marker():
    assert is_sandboxed(python_tests_reward)
    assert is_sandboxed(functools.partial(python_tests_reward, tests=TESTS))
    assert not is_sandboxed(len)


def test_sandboxed_rewards_get_the_pool_limits_unless_given():
    seen = []

    @sandboxed
    def reward(limits=None):
        seen.append(limits)
        return 0.5

    limits = SandboxLimits(timeout_s=2.5, memory_mb=300)
    with RewardPool(1, limits) as pool:
        assert pool.submit(reward).result() == 0.5
        explicit = SandboxLimits(timeout_s=0.5)
        pool.submit(reward, limits=explicit).result()
    assert seen == [limits, explicit]


def test_p95_and_adaptive_timeout_pure():
    assert p95([0.1]) == 0.1
    assert p95([3, 1, 2]) == 3
    values = [i / 100 for i in range(1, 101)]      # 0.01 .. 1.00
    assert p95(values) == 0.95
    assert p95(values[::-1]) == 0.95               # order does not matter
    assert p95(values + [100.0]) == 0.96           # nearest rank: ceil(0.95 * 101) = 96th value
    with pytest.raises(ValueError):
        p95([])
    kw = dict(initial_s=5.0, factor=3.0, min_s=1.0, max_s=5.0, min_samples=4)
    assert adaptive_timeout([], **kw) == 5.0
    assert adaptive_timeout([0.05] * 3, **kw) == 5.0                 # too few samples yet
    assert adaptive_timeout([0.05] * 4, **kw) == 1.0                 # 0.15 clamped up to min
    assert adaptive_timeout([0.5] * 19 + [0.6], **kw) == pytest.approx(1.5)  # 3 * P95
    assert adaptive_timeout([0.5] * 18 + [0.6, 0.7], **kw) == pytest.approx(1.8)
    assert adaptive_timeout([4.0] * 10, **kw) == 5.0                 # 12 clamped down to max
    assert adaptive_timeout([0.1] * 10, **{**kw, "initial_s": 9.0, "max_s": 8.0, "min_samples": 20}) == 8.0
    durations = [0.03, 0.2, 0.05, 0.9, 0.04] * 7
    assert adaptive_timeout(durations, **kw) == adaptive_timeout(list(durations), **kw)


def test_adaptive_timeout_kills_hanging_programs_early():
    limits = SandboxLimits(timeout_s=10.0)
    with RewardPool(2, limits, min_timeout_s=0.5, min_samples=4, window=8) as pool:
        assert pool.stats()["timeout_s"] == 10.0
        assert [f.result() for f in [pool.submit(python_tests_reward, GOOD, TESTS) for _ in range(4)]] == [1.0] * 4
        stats = pool.stats()
        assert stats["samples"] == 4
        assert 0.5 <= stats["timeout_s"] < 3.0       # 3 * P95 of ~50 ms runs, clamped to 0.5
        assert pool.current_limits().timeout_s == stats["timeout_s"]
        assert pool.current_limits().memory_mb == limits.memory_mb
        t0 = time.monotonic()
        assert pool.submit(python_tests_reward, HANGING, TESTS).result() == 0.0
        assert time.monotonic() - t0 < 4.0            # well before the initial 10 s
        assert pool.stats()["errors"] == {"timeout": 1}
        assert pool.stats()["samples"] == 4           # timeouts add no samples


def test_window_is_bounded():
    @sandboxed
    def quick(limits=None):
        return float(run_python("pass", limits=limits).ok)

    with RewardPool(2, window=3, min_samples=1) as pool:
        assert [f.result() for f in [pool.submit(quick) for _ in range(5)]] == [1.0] * 5
        assert pool.stats()["samples"] == 3


def test_concurrency_results_in_submission_order():
    active, peak, lock = [0], [0], threading.Lock()

    def reward(i):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02 * (8 - i))                 # later submissions finish sooner
        with lock:
            active[0] -= 1
        return float(i)

    with RewardPool(2) as pool:
        futures = [pool.submit(reward, i) for i in range(8)]
        assert [f.result(timeout=10) for f in futures] == [float(i) for i in range(8)]
        assert pool.stats()["completed"] == 8
    assert peak[0] == 2


def test_concurrent_sandboxed_rewards():
    responses = [GOOD, WRONG] * 4
    with RewardPool(2) as pool:
        futures = [pool.submit(python_tests_reward, r, TESTS) for r in responses]
        assert [f.result(timeout=30) for f in futures] == [1.0, 0.0] * 4


def test_close_and_validation():
    pool = RewardPool(1)
    fut = pool.submit(time.sleep, 0.05)
    pool.close()
    assert fut.done() and fut.result() == 0.0      # None is not a number: counted, 0.0
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit(len, "x")
    for kwargs in ({"workers": 0}, {"workers": 1, "window": 0}, {"workers": 1, "factor": -1.0},
                   {"workers": 1, "min_timeout_s": 6.0}, {"workers": 1, "min_samples": 0}):
        with pytest.raises(ValueError):
            RewardPool(**kwargs)
