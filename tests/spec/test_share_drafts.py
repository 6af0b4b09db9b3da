"""Draft sharing between rollout replicas (``Speculator.share_drafts``, called by the rollout stage
after a step): the other replicas' samples become history drafts, and their bubble drafts for the
next step are merged, the longer of two drafts for one request kept."""
from megarl.engine import Request, Result
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator


def _result(uid: int, i: int, prompt: list[int], tokens: list[int]) -> Result:
    return Result(uid, i, prompt, tokens, [0.0] * len(tokens), [], "stop", len(tokens))


def _speculator() -> Speculator:
    return Speculator(SpecConfig(enabled=True, sources=("bubble", "history"), suffix_backend="python"))


def test_a_replica_gets_the_others_samples_and_bubble_drafts():
    a, b = _speculator(), _speculator()
    a.bubble.store(3, [_result(7, 0, [1, 2], [5, 6, 7])])
    b.bubble.store(3, [_result(7, 0, [1, 2], [5, 6]), _result(8, 1, [3], [9])])
    sent = []

    def from_others(obj):  # the collective as replica a sees it: replica b's object
        sent.append(obj)
        return [b.bubble.drafts(3)]

    assert a.source("history").propose(Request(4, 1, [1, 2, 3]), [10, 11], k=2) is None
    a.share_drafts([[_result(4, 0, [1, 2, 3], [10, 11, 12, 13])]], 2, from_others)
    assert sent == [{(7, 0): [5, 6, 7]}]  # this replica's step + 1 drafts go to the others
    assert a.bubble.drafts(3) == {(7, 0): [5, 6, 7], (8, 1): [9]}  # of two drafts, the longer one
    proposal = a.source("history").propose(Request(4, 1, [1, 2, 3]), [10, 11], k=2)
    assert proposal is not None and proposal.tokens == [12, 13]  # the other replica's sample


def test_without_a_bubble_source_nothing_is_exchanged():
    spec = Speculator(SpecConfig(enabled=True, sources=("history",), suffix_backend="python"))

    def from_others(obj):
        raise AssertionError("no collective without a bubble source")

    spec.share_drafts([[_result(4, 0, [1, 2, 3], [10, 11, 12])]], 0, from_others)
    assert spec.source("history").propose(Request(4, 1, [1, 2, 3]), [10], k=2).tokens == [11, 12]
