"""``python -m benchmarks.gpu.runbook``: the runner (:mod:`benchmarks.gpu.runbook.runner`)."""
import sys

from benchmarks.gpu.runbook.runner import main

sys.exit(main())
