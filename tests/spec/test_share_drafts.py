"""Draft sharing between rollout replicas (``Speculator.share_drafts``, called by the rollout stage
after a step): the other replicas' samples become history drafts, and their bubble drafts for the
next step are merged, the longer of two drafts for one request kept. The collective is replaced
here by what it returns on replica 0 of 2."""
import torch.distributed as dist

from megarl.engine import Request, Result
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator


def _result(uid: int, i: int, prompt: list[int], tokens: list[int]) -> Result:
    return Result(uid, i, prompt, tokens, [0.0] * len(tokens), [], "stop", len(tokens), temperature=1.0)


def _speculator(sources=("bubble", "history")) -> Speculator:
    return Speculator(SpecConfig(enabled=True, sources=sources, suffix_backend="python"))


def test_a_replica_gets_the_others_samples_and_bubble_drafts(monkeypatch):
    a, b = _speculator(), _speculator()
    a.bubble.store(3, [_result(7, 0, [1, 2], [5, 6, 7])])
    b.bubble.store(3, [_result(7, 0, [1, 2], [5, 6]), _result(8, 1, [3], [9])])
    sent = []

    def all_gather_object(out, obj, group=None):  # replica 0 (a) of 2: [a's, b's]
        assert group == "dp"
        sent.append(obj)
        out[:] = [obj, b.bubble.drafts(3)]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert a.source("history").propose(Request(4, 1, [1, 2, 3]), [10, 11], k=2) is None
    a.share_drafts([[_result(4, 0, [1, 2, 3], [10, 11, 12, 13])]], 2, "dp")
    assert sent == [{(7, 0): [5, 6, 7]}]  # this replica's step + 1 drafts go to the others
    assert a.bubble.drafts(3) == {(7, 0): [5, 6, 7], (8, 1): [9]}  # of two drafts, the longer one
    proposal = a.source("history").propose(Request(4, 1, [1, 2, 3]), [10, 11], k=2)
    assert proposal is not None and proposal.tokens == [12, 13]  # the other replica's sample


def test_without_a_bubble_source_nothing_is_exchanged(monkeypatch):
    spec = _speculator(("history",))

    def all_gather_object(out, obj, group=None):
        raise AssertionError("no collective without a bubble source")

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    spec.share_drafts([[_result(4, 0, [1, 2, 3], [10, 11, 12])]], 0, "dp")
    assert spec.source("history").propose(Request(4, 1, [1, 2, 3]), [10], k=2).tokens == [11, 12]
