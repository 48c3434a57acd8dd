"""Logging setup for Springback processes: human lines or JSON lines.

``SPRINGBACK_LOG_LEVEL`` (default WARNING) sets the level;
``SPRINGBACK_LOG_FORMAT=json`` emits one JSON object per record (time, level,
logger, message, and exception text when present) for log pipelines.
"""

from __future__ import annotations

import json
import logging
import os

from springback.client import env as E


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure() -> None:
    """Configures the root logger from the environment (idempotent)."""
    handler = logging.StreamHandler()
    if os.environ.get(E.LOG_FORMAT, "").lower() == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get(E.LOG_LEVEL, "WARNING").upper())
