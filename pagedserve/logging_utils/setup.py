"""How a pagedserve process logs: a level and a line format (text for people, JSON for log pipelines), set
once per process from `--log-level` and `--log-format`, and handed on to the engine-core process."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from pagedserve.logging_utils.json_formatter import JsonFormatter

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(levelname)s %(name)s{process}: %(message)s"


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "info"
    format: str = "text"

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {self.format!r}")

    @property
    def level_number(self) -> int:
        return getattr(logging, self.level.upper())


class StderrHandler(logging.StreamHandler):
    """A stream handler on whatever sys.stderr is when a record is written (not the one at creation: a test
    harness or a daemonizer may swap it, and the old one may be closed by then)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(config: LoggingConfig, process_name: str = "") -> None:
    """One stderr handler on the root logger, in the configured format (replacing any handler a library or an
    earlier call put there); uvicorn's loggers propagate to it (the server runs uvicorn with log_config=None)."""
    handler = StderrHandler()
    if config.format == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(process=f" ({process_name})" if process_name
                                                                   else "")))
    handler.pagedserve = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "pagedserve", False)]:
        root.removeHandler(old)  # a second call replaces the first's handler; others' (pytest's) stay
    root.addHandler(handler)
    root.setLevel(config.level_number)
    logging.captureWarnings(config.format == "json")  # a Python warning becomes a JSON line, not raw stderr
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def current_logging() -> LoggingConfig:
    """This process's logging, as a config a child process can apply (the engine-core process logs as its
    front end does)."""
    level = logging.getLevelName(logging.getLogger("pagedserve").getEffectiveLevel()).lower()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return LoggingConfig(level if level in LOG_LEVELS else "info", "json" if json_lines else "text")
