"""``rollout.backend=vllm`` refuses at start, with one line naming the key, what the vLLM backend
does not run yet (megarl/setup_run.py ``check_vllm_backend``)."""
import pytest

from megarl.config import load_config
from megarl.setup_run import check_vllm_backend
from tests.conftest import tiny_args
from tests.vllm_marks import needs_vllm


@pytest.mark.parametrize("sets,match", [
    (["parallel.rollout_tp=2"], "does not support parallel.rollout_tp=2"),
    (["tail.enabled=true", "tail.long_rollout_tp=2"], "does not support tail.long_rollout_tp=2"),
    (["rollout.dtype=float64"], "does not support rollout.dtype=float64"),
    (["spec.enabled=true", "spec.drafter.enabled=true"], "does not support spec.drafter.enabled=true"),
    (["spec.enabled=true", "spec.bubble_pregen=true"], "does not support spec.bubble_pregen=true"),
    (["spec.enabled=true"], "does not support speculation at temperature 1.0 .rollout or eval."),
    (["rollout.temperature=0", "eval.temperature=0.5", "rollout.vllm_spec.method=ngram"],
     "does not support speculation at temperature 0.5"),
    (["rollout.temperature=0", "spec.enabled=true", "rollout.vllm_spec.method=ngram"],
     "does not support spec.enabled=true together with rollout.vllm_spec.method=ngram"),
    (["rollout.temperature=0", "spec.enabled=true", "tail.enabled=true"],
     "does not support drafts together with tail.enabled=true"),
    (["rollout.temperature=0.7", "rollout.top_k=20"], "temperature=0.7 with top_k/top_p on"),
    (["rollout.temperature=0.7", "rollout.top_p=0.9"], "temperature=0.7 with top_k/top_p on"),
])
def test_refused_with_one_line(sets, match):
    cfg = load_config(None, ["rollout.backend=vllm", *sets])
    with pytest.raises(ValueError, match=match) as e:
        check_vllm_backend(cfg, tiny_args("llama"))
    assert "\n" not in str(e.value) and "rollout.backend=megarl" in str(e.value)


@needs_vllm
@pytest.mark.parametrize("sets", [["tail.enabled=true"], ["stream_train=true", "rollout.placement=length"],
                                  ["parallel.placement=disaggregated", "parallel.rollout_ranks=1"]])
def test_what_the_vllm_backend_runs_is_accepted(sets):
    """Tail batching, stream training, length placement and disaggregated placement run on the vLLM
    backend (tests/stages/test_vllm_rollout.py, tests/test_vllm_parallel_run.py): not refused."""
    check_vllm_backend(load_config(None, ["rollout.backend=vllm", *sets]), tiny_args("llama"))


def test_moe_is_refused_and_megarl_is_the_default():
    assert load_config(None, []).rollout.backend == "megarl"
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_vllm_backend(load_config(None, ["rollout.backend=vllm"]),
                           tiny_args("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))


def test_without_vllm_the_backend_fails_at_start(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_vllm(name, *a, **kw):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ValueError, match=r"vLLM cannot be imported here .*make vllm"):
        check_vllm_backend(load_config(None, ["rollout.backend=vllm"]), tiny_args("llama"))


def test_vllm_speculation_settings_are_checked_at_start():
    """vLLM's own speculation is a vLLM-backend setting; megarl's draft sources are allowed on it."""
    from megarl.engine.vllm_spec import suffix_missing
    from megarl.setup_run import check_layout

    cfg = load_config(None, ["rollout.vllm_spec.method=ngram"])
    with pytest.raises(ValueError, match=r"rollout.vllm_spec.method=ngram is vLLM's speculation, but "
                                         r"rollout.backend=megarl; valid: rollout.backend=vllm"):
        check_layout(cfg, tiny_args("llama"))
    with pytest.raises(ValueError, match=r"rollout.vllm_spec.method: 'eagle' is not a valid choice"):
        load_config(None, ["rollout.vllm_spec.method=eagle"])
    if not suffix_missing():
        pytest.skip("arctic_inference is installed here: suffix decoding is not refused")
    with pytest.raises(ValueError, match=r"rollout.vllm_spec.method=suffix: .*arctic_inference"):
        check_vllm_backend(load_config(None, ["rollout.backend=vllm", "rollout.temperature=0",
                                       "rollout.vllm_spec.method=suffix"]),
                           tiny_args("llama"))
