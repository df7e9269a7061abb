"""The text and JSON line formats, and the logging a child process inherits."""

from __future__ import annotations

import json
import logging

import pytest

from pagedserve.logging_utils import LoggingConfig, configure_logging, current_logging
from pagedserve.logging_utils.json_formatter import JsonFormatter


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    uvicorn = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("pagedserve").setLevel(logging.NOTSET)
    logging.captureWarnings(False)
    for name, (saved, propagate) in uvicorn.items():
        logging.getLogger(name).handlers[:] = saved
        logging.getLogger(name).propagate = propagate


def record(message: str = "hello %s", args=("world",), **extra) -> logging.LogRecord:
    rec = logging.LogRecord("pagedserve.test", logging.WARNING, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_a_json_line_has_time_level_logger_message_and_the_records_fields_at_the_top():
    line = json.loads(JsonFormatter("engine core").format(record(fields={"request_id": "r1", "status": 200,
                                                                         "level": "not this one"})))
    assert line["message"] == "hello world" and line["level"] == "WARNING" and line["logger"] == "pagedserve.test"
    assert line["request_id"] == "r1" and line["status"] == 200 and line["process"] == "engine core"
    assert line["time"].endswith("+00:00") and "T" in line["time"]


def test_a_json_line_carries_the_traceback_and_stays_one_line():
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), __import__("sys").exc_info())
    text = JsonFormatter().format(rec)
    assert "\n" not in text and "RuntimeError: boom" in json.loads(text)["exception"]


def test_configure_logging_replaces_its_own_handler_and_keeps_others(restore_root_logging):
    root = restore_root_logging
    others = [h for h in root.handlers if not getattr(h, "pagedserve", False)]
    configure_logging(LoggingConfig("debug", "text"))
    configure_logging(LoggingConfig("warning", "json"))
    ours = [h for h in root.handlers if getattr(h, "pagedserve", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)
    assert all(h in root.handlers for h in others) and root.level == logging.WARNING
    assert current_logging() == LoggingConfig("warning", "json")


def test_an_unknown_level_or_format_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="debug, info"):
        LoggingConfig(level="verbose")
    with pytest.raises(ValueError, match="text, json"):
        LoggingConfig(format="xml")


def test_the_handler_writes_to_the_stderr_of_the_moment_not_a_closed_one(restore_root_logging, monkeypatch):
    import io

    configure_logging(LoggingConfig("info", "json"))
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    logging.getLogger("pagedserve.test").info("one")
    first.close()  # as pytest closes a finished test's capture
    monkeypatch.setattr("sys.stderr", second)
    logging.getLogger("pagedserve.test").info("two")
    assert json.loads(second.getvalue())["message"] == "two"
