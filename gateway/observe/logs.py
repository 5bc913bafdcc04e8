"""structlog set-up: JSON lines on stderr, or a console renderer on a TTY.

stdout is kept for command output (``--json`` documents), so logs never mix
into it. Warnings and errors are rate-limited per cause (the event name, or
uvicorn's message template): ``REPEATS_PER_WINDOW`` lines of one cause per
``WINDOW_S``, then silence until the window ends, and the next line of that
cause carries ``suppressed`` (how many were dropped). A client that makes the
server warn on every request (2,000 h2c upgrades wrote 2,000 lines) cannot
flood the log.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

REPEATS_PER_WINDOW = 10
WINDOW_S = 60.0


class RepeatLimit:
    """Per cause: at most ``burst`` lines in each ``window_s``."""

    def __init__(
        self, burst: int = REPEATS_PER_WINDOW, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[str, list[float | int]] = {}  # cause -> [window start, lines, suppressed]

    def admit(self, cause: str) -> int | None:
        """None: drop this line; else how many of its cause were dropped before it."""
        now = self.clock()
        window = self._windows.get(cause)
        if window is None or now - window[0] >= self.window_s:
            suppressed = int(window[2]) if window is not None else 0
            if len(self._windows) > 10_000:  # causes are code's, not clients', but stay bounded anyway
                self._windows.clear()
            self._windows[cause] = [now, 1, 0]
            return suppressed
        if window[1] < self.burst:
            window[1] += 1
            return 0
        window[2] += 1
        return None


class _StdlibRepeats(logging.Filter):
    def __init__(self, limit: RepeatLimit) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        suppressed = self.limit.admit(f"{record.name}:{record.msg}")
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} more like it suppressed)"
        return suppressed is not None


def limit_stdlib_repeats(*names: str) -> None:
    """Rate-limit these stdlib loggers' warnings (uvicorn's, after it configured them)."""
    limit = RepeatLimit()
    for name in names:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _StdlibRepeats)]:  # one server after another
            logger.removeFilter(old)
        logger.addFilter(_StdlibRepeats(limit))


def _repeats_processor(limit: RepeatLimit) -> Callable[[Any, str, MutableMapping[str, Any]], MutableMapping[str, Any]]:
    levels = {"warning", "error", "critical", "exception"}

    def processor(_logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method in levels:
            suppressed = limit.admit(str(event.get("event")))
            if suppressed is None:
                raise structlog.DropEvent
            if suppressed:
                event["suppressed"] = suppressed
        return event

    return processor


class _Stderr:
    """Whatever sys.stderr is at write time (tests and daemons swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            _repeats_processor(RepeatLimit()),
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
