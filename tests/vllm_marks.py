"""Whether the optional vLLM backend (``make vllm``) can run here: its tests skip with the reason
when it cannot, except under MEGARL_REQUIRE_VLLM=1 (CI installs it), where they must run."""
import os

import pytest

from megarl.engine.vllm_backend import vllm_missing

MISSING = vllm_missing()
needs_vllm = pytest.mark.skipif(MISSING is not None and os.environ.get("MEGARL_REQUIRE_VLLM") != "1",
                                reason=f"vLLM cannot be imported here ({MISSING}); `make vllm` installs it")
