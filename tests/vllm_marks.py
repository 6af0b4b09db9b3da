"""Whether the optional vLLM backend (``make vllm``) is installed: its tests skip with the reason
when it is not, except under MEGARL_REQUIRE_VLLM=1 (CI installs it), where they must run. Only
looked up, not imported: collecting the suite does not load vLLM (its tests import it when run,
and fail if an install is broken, e.g. by a CUDA torchvision)."""
import importlib.util
import os

import pytest

INSTALLED = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not INSTALLED and os.environ.get("MEGARL_REQUIRE_VLLM") != "1",
                                reason="vLLM is not installed here; `make vllm` installs it (rollout.backend=vllm)")
