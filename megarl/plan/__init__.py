"""The memory plan (``megarl plan``, the start check of ``megarl train``): per-GPU bytes of every
term of a run from its model, layout and sizes (docs/memory_plan.md)."""
