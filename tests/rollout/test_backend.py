"""The rollout backend interface (megarl/rollout/backend.py): megarl's engine and the vLLM backend
both have every member of ``RolloutBackend`` with a compatible signature, and the rollout stage
and the step's stages call nothing else on an engine."""
import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from megarl.engine import Engine
from megarl.engine.vllm_backend import VLLMEngine
from megarl.rollout.backend import RolloutBackend

ROOT = Path(__file__).resolve().parents[2] / "megarl"
BACKENDS = [Engine, VLLMEngine]
METHODS = sorted(n for n, v in vars(RolloutBackend).items() if callable(v) and not n.startswith("_"))
ATTRIBUTES = sorted(RolloutBackend.__annotations__)
VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _set_on_self(cls) -> set[str]:
    """Attributes ``cls`` (or a base) assigns to ``self`` in any of its methods, and its properties."""
    out = set()
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.add(node.attr)
        out |= {n for n, v in vars(klass).items() if isinstance(v, property)}
    return out


def test_the_interface_is_what_the_docs_say():
    assert METHODS == ["after_sync", "close", "generate", "pregenerate", "reset_stats"]
    assert ATTRIBUTES == ["device", "model", "spec", "stats", "tp_rank", "tp_size"]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_method_with_a_compatible_signature(cls, name):
    """Every parameter of the Protocol's method, with its kind and default, in its order; any
    parameter more must have a default (a caller of the Protocol never passes it)."""
    assert callable(getattr(cls, name, None)), f"{cls.__name__} has no method {name}"
    want = inspect.signature(getattr(RolloutBackend, name)).parameters
    got = inspect.signature(getattr(cls, name)).parameters
    for p in want.values():
        q = got.get(p.name)
        assert q is not None, f"{cls.__name__}.{name} lacks the parameter {p.name}"
        assert (q.kind, q.default) == (p.kind, p.default), f"{cls.__name__}.{name}({p.name}) differs: {q} vs {p}"
    assert [n for n in got if n in want] == list(want), f"{cls.__name__}.{name}: parameters in another order"
    extra = [q for n, q in got.items() if n not in want and q.kind not in VARIADIC]
    assert all(q.default is not inspect.Parameter.empty for q in extra), f"{cls.__name__}.{name}: {extra}"


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_attribute_is_set(cls):
    assert set(ATTRIBUTES) - _set_on_self(cls) == set()


def _engine_uses(path: Path) -> set[str]:
    """Attributes read off ``engine`` or ``<anything>.engine`` in ``path``."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "engine") or (isinstance(v, ast.Attribute) and v.attr == "engine"):
                used.add(node.attr)
    return used


def test_the_rollout_side_calls_only_the_interface():
    files = sorted((ROOT / "rollout").glob("*.py")) + sorted((ROOT / "stages").glob("*.py"))
    used = {f"{p.relative_to(ROOT.parent)}: engine.{a}" for p in files for a in _engine_uses(p)
            if a not in METHODS and a not in ATTRIBUTES}
    assert used == set()
    assert _engine_uses(ROOT / "rollout" / "stage.py") >= {"generate", "pregenerate", "reset_stats", "stats", "spec"}


def test_the_vllm_backend_refuses_pregeneration_clearly():
    engine = object.__new__(VLLMEngine)  # no vLLM started: the refusal comes before any use of it
    with pytest.raises(ValueError, match="does not pre-generate drafts.*purpose='rollout'"):
        engine.pregenerate([], 1)
