"""Stream training: a step's groups trained while its rollout still runs (docs/design.md §3)."""
