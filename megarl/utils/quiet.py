"""Megatron-core's known, expected warnings as one log line instead of a wall before the progress bar.

Without NVIDIA Apex and Transformer Engine (CPU machines, plain pip installs) megatron-core
warns at import and model build that it falls back to local implementations (one warning per
module, per process), and its RerunStateMachine logs two WARNING lines although megarl never
uses it. On CPU it also recommends ``CUDA_DEVICE_MAX_CONNECTIONS``, a CUDA setting. None of this
needs action, and it buried the lines that do. :func:`install` hides exactly these messages
(:data:`KNOWN_WARNINGS`, :data:`KNOWN_LOGS`: message patterns, each tied to its category and to
megatron/core's files or loggers) and logs in their place, at the first one hidden, one INFO
line: ``megatron-core: using local fallbacks (no Apex, no Transformer Engine); its known
warnings about them are hidden``. Anything else, including other megatron-core warnings and
the CUDA hint on a GPU machine, is shown as before. ``MEGARL_SHOW_KNOWN_WARNINGS=1`` shows all.

Why a ``warnings.showwarning`` hook and not an ``ignore`` filter: an ignored warning leaves no
trace, so nothing could say that the fallbacks are in use. The hook sees only what the warning
filters let through, so ``-W error`` or ``-W ignore`` keep working, and its once-per-location
deduplication still applies.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SHOW_ENV = "MEGARL_SHOW_KNOWN_WARNINGS"


def _no_cuda() -> bool:
    torch = sys.modules.get("torch")  # megatron-core has imported it by the time it warns
    return torch is not None and not torch.cuda.is_available()


@dataclass(frozen=True)
class Known:
    """One known message: ``pattern`` matched against the whole message text."""

    pattern: str
    where: str
    """``warnings``: a regex on the warning's file path; ``logging``: the logger's name."""
    category: type[Warning] = UserWarning
    when: Callable[[], bool] | None = None
    """Hide only when this is true (None: always)."""

    def matches(self, text: str) -> bool:
        return re.fullmatch(self.pattern, text, flags=re.DOTALL) is not None and (self.when is None or self.when())


_MCORE_FILE = r".*[/\\]megatron[/\\]core[/\\].*"
KNOWN_WARNINGS: tuple[Known, ...] = (
    Known(r"Apex is not installed\. Falling back to Torch Norm", _MCORE_FILE),
    # optimizer/__init__.py, optimizer.py, clip_grads.py, megatron_fsdp/mixed_precision.py
    Known(r"Transformer Engine and Apex are not installed\. Falling back to (Torch optimizers\.|local "
          r"implementations of multi_tensor_applier[a-z0-9_, ]*)", _MCORE_FILE),
    # tensor_parallel/layers.py: a CUDA stream setting, meaningless without CUDA
    Known(r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
          r"variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", _MCORE_FILE, when=_no_cuda),
)
"""Warnings hidden by :func:`install`."""

KNOWN_LOGS: tuple[Known, ...] = (
    Known(r"Implicit initialization of Rerun State Machine!", "megatron.core.rerun_state_machine"),
    Known(r"RerunStateMachine initialized in mode RerunMode\.DISABLED", "megatron.core.rerun_state_machine"),
)
"""Log records (WARNING) hidden by :func:`install`."""

hidden: Counter[str] = Counter()
"""Messages hidden so far in this process, by pattern."""

_installed = False
_previous_showwarning = None


def _summary() -> str:
    missing = [name for name, mod in (("Apex", "apex"), ("Transformer Engine", "transformer_engine"))
               if importlib.util.find_spec(mod) is None]
    what = f"local fallbacks (no {', no '.join(missing)})" if missing else "local fallbacks"
    return f"megatron-core: using {what}; its known warnings about them are hidden ({SHOW_ENV}=1 shows them)"


def _hide(known: Known) -> None:
    if not hidden:
        log.info("%s", _summary())
    hidden[known.pattern] += 1


def _showwarning(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    for known in KNOWN_WARNINGS:
        if issubclass(category, known.category) and re.fullmatch(known.where, filename or "") and known.matches(text):
            _hide(known)
            return
    _previous_showwarning(message, category, filename, lineno, file, line)


class _KnownLogFilter(logging.Filter):
    """Drops the known records of one logger (attached to that logger, so only its own records)."""

    def __init__(self, known: tuple[Known, ...]):
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for known in self.known:
            if known.matches(text):
                _hide(known)
                return False
        return True


def install() -> None:
    """Hide the known messages from here on (idempotent; no-op with ``MEGARL_SHOW_KNOWN_WARNINGS=1``)."""
    global _installed, _previous_showwarning
    if _installed or os.environ.get(SHOW_ENV, "") not in ("", "0"):
        return
    _installed = True
    _previous_showwarning = warnings.showwarning
    warnings.showwarning = _showwarning
    for name in sorted({k.where for k in KNOWN_LOGS}):
        logging.getLogger(name).addFilter(_KnownLogFilter(tuple(k for k in KNOWN_LOGS if k.where == name)))
