"""The Megatron-core trainer: model, update, state and checkpoints, logprobs, and the patches that
run Megatron-core on CPU (docs/design.md §2)."""
