"""Speculative rollouts, exact by construction (docs/design.md §1.2): draft sources (history,
group, prompt, bubble: ``sources.py``; the learned drafter: ``drafter*.py``), the policy that
picks and sizes drafts per request and batch (``speculator.py``, ``bandit.py``) and the suffix
index behind the history drafts (``suffix_index.py``, C++ twin in ``csrc/``). Verification itself
is the engine's (megarl/engine/verify.py): it calls the sampler."""
