"""Secret values never reach a log line: a filter on every root handler (mitmproxy logs WebSocket
pings, protocol errors and tracebacks that may quote what an upstream sent)."""

from __future__ import annotations

import logging


class LogRedaction(logging.Filter):
    """A logging filter on every root handler: secret values never reach a log line."""

    _installed: "LogRedaction | None" = None

    def __init__(self, get_redactor):
        super().__init__()
        self.get_redactor = get_redactor

    @classmethod
    def install(cls, get_redactor) -> None:
        if cls._installed is None:
            cls._installed = cls(get_redactor)
        cls._installed.get_redactor = get_redactor
        for handler in logging.getLogger().handlers:
            if cls._installed not in handler.filters:
                handler.addFilter(cls._installed)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            redactor = self.get_redactor()
            if redactor is not None:
                message = record.getMessage()
                clean, hits = redactor.redact_text(message)
                if hits:
                    record.msg, record.args = clean, ()
                if record.exc_info and record.exc_info[1] is not None:
                    text, hits = redactor.redact_text(str(record.exc_info[1]))
                    if hits:
                        record.exc_info = None
                        record.exc_text = None
                        record.msg = f"{record.msg} [exception text withheld: it contained a secret]"
        except Exception:
            pass
        return True
