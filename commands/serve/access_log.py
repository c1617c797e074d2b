"""serve's log lines: llama-server's one line per request on stderr (health checks left out),
and uvicorn's own lines only from warnings up."""

from __future__ import annotations

import logging


class NotHealth(logging.Filter):
    """llama-server logs every request but health checks."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).startswith("/health"))


# uvicorn's own lines only from warnings up; one line per request on stderr, llama-server's
# "request: METHOD PATH ADDRESS STATUS"
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s"},
        "access": {
            "()": "uvicorn.logging.AccessFormatter",
            "fmt": "serve: request: %(request_line)s %(client_addr)s %(status_code)s",
            "use_colors": False,
        },
    },
    "filters": {"not_health": {"()": NotHealth}},
    "handlers": {
        "default": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
        "access": {
            "formatter": "access",
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "filters": ["not_health"],
        },
    },
    "loggers": {
        "uvicorn": {"handlers": ["default"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
    },
}
