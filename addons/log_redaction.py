"""Secret values never reach a log line: a filter on every root handler (mitmproxy logs WebSocket
pings, protocol errors and tracebacks that may quote what an upstream sent).

A traceback is redacted as it will be printed: the whole formatted text, with the exceptions it
chains (`__cause__`, `__context__`), their notes and an exception group's members. Only the
exception's own text was looked at, and a secret in a chained exception or a note was printed
(review 49: the crash line of addons/crash_close.py, an injected `Authorization` in the context)."""

from __future__ import annotations

import logging

_FORMATTER = logging.Formatter()  # formatException only: the same text every handler's formatter makes


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
        # logging.lastResort prints WARNING and above once mitmproxy's handlers are gone (after its
        # `done`, while open connections are still cancelled): unfiltered, a line then went out as
        # it was (review 50).
        for handler in [*logging.getLogger().handlers, logging.lastResort]:
            if handler is not None and cls._installed not in handler.filters:
                handler.addFilter(cls._installed)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            redactor = self.get_redactor()
            if redactor is not None:
                message = record.getMessage()
                clean, hits = redactor.redact_text(message)
                if hits:
                    record.msg, record.args, message = clean, (), clean
                if record.exc_info and record.exc_info[1] is not None:
                    text = record.exc_text or _FORMATTER.formatException(record.exc_info)
                    traceback, hits = redactor.redact_text(text)
                    if hits:
                        # Into the message: mitmproxy's formatter prints exc_info, never exc_text,
                        # and the traceback is what the operator needs (review 50).
                        record.msg, record.args = f"{message}\n{traceback}", ()
                        record.exc_info = record.exc_text = None
                elif record.exc_text:
                    record.exc_text = redactor.redact_text(record.exc_text)[0]
                if record.stack_info:
                    record.stack_info = redactor.redact_text(record.stack_info)[0]
        except Exception:  # the redactor failed: nothing of the line goes out unchecked
            record.msg, record.args = "egress gateway: a log line was withheld (its redaction failed)", ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True
