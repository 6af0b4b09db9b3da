"""What runs on the GPU machine: the runbook (``runbook/``) and its shell wrapper."""
