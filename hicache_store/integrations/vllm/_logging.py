"""This library's log lines in vLLM's log, in vLLM's format.

vLLM configures its own logger (``vllm``: a stream handler with process, pid, level, time and
``file:line``; ``propagate=False``) and leaves the root logger alone. A library's records go to
the root logger's handlers, and where there are none to Python's last-resort handler, which
prints the bare message. ``attach`` gives the ``hicache_store`` logger one handler that passes
each record to vLLM's handlers, unless the root logger has handlers of its own (an
application's logging configuration, or pytest's), which the record reaches anyway: one line
per record either way. Where vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``) records go to
the last-resort handler, as before.
"""

from __future__ import annotations

import logging
import os

LOGGER = "hicache_store"


class _ThroughVllm(logging.Handler):
    """Hands a record to the ``vllm`` logger's handlers when nothing else will print it."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # propagates to the application's own handlers
        handlers: list[logging.Handler | None] = [*logging.getLogger("vllm").handlers]
        for handler in handlers or [logging.lastResort]:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def attach() -> None:
    """Route ``hicache_store``'s records as the module docstring says (once per process). The
    logger's level, where nobody set it, becomes vLLM's (``VLLM_LOGGING_LEVEL``, INFO by
    default), so that its INFO lines appear beside vLLM's."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, _ThroughVllm) for h in logger.handlers):
        return
    logger.addHandler(_ThroughVllm())
    if logger.level == logging.NOTSET:
        logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
