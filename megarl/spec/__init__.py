"""Speculative rollouts (issue 3): not built yet. The engine decodes one token per forward today;
the exactness contract it relies on (counter-based noise keyed on the response position) is in
``megarl/engine/sampler.py``."""
