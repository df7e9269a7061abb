"""Logging: the text or JSON line format of every pagedserve process, and the server's one line per request."""

from pagedserve.logging_utils.setup import LOG_FORMATS, LOG_LEVELS, LoggingConfig, configure_logging, current_logging

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "LoggingConfig", "configure_logging", "current_logging"]
