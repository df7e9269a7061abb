"""One JSON object per log line, for log pipelines that should need no regex."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

FIELDS_ATTR = "fields"
"""A record's structured fields: `logger.info(msg, extra={"fields": {...}})` puts them at the top level of the
JSON object (and the text format leaves them out: its message says the same)."""


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str = "") -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.process_name:
            line["process"] = self.process_name
        fields = getattr(record, FIELDS_ATTR, None)
        if isinstance(fields, dict):
            line.update({k: v for k, v in fields.items() if k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)
