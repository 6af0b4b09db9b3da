"""The GPU runbook: every GPU-side measurement and check in one command, each part in its own
process (docs/gpu/README.md). A developer tool run from the repository root, not part of the
installed ``megarl`` package."""
