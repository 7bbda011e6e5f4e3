"""Fail closed: mitmproxy logs and ignores exceptions raised in hooks, which would let the flow
through. Every decision hook is wrapped so that an exception becomes a refusal instead.

An audit log that cannot be written (gateway.audit.AuditWriteError: a full disk, the supervisor's
state byte set) is expected, not a bug: the decision still fails closed (the fallback answers 500
internal_error), but without a traceback: one warning a second at most, with the count of refusals
since the last one (two tracebacks per refusal were 165,373 log lines in 8 s, on the full disk).
`QuietAuditFailures` withholds the tracebacks of such errors from every other log line too."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable

from gateway.audit import AuditWriteError

logger = logging.getLogger("egress.failclosed")


class _Unwritable:
    """Counts refusals (and withheld tracebacks) while the audit log is unwritable; warns at most
    once every `interval` seconds."""

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self.refused = 0
        self.withheld = 0
        self.total = 0  # refusals over the process's life (tests, metrics)
        self._last = float("-inf")
        self._lock = threading.Lock()

    def note(self, exc: BaseException, refused: bool = True) -> None:
        with self._lock:
            if refused:
                self.refused += 1
                self.total += 1
            else:
                self.withheld += 1
            now = self.clock()
            if now - self._last < self.interval:
                return
            self._last = now
            refused_n, withheld_n = self.refused, self.withheld
            self.refused = self.withheld = 0
        why = getattr(exc, "strerror", None) or type(exc).__name__
        logger.warning("egress gateway: the audit log is not writable (%s): %d decision(s) refused (500 "
                       "internal_error) since the last warning%s", why, refused_n,
                       f", {withheld_n} traceback(s) withheld" if withheld_n else "")


unwritable = _Unwritable()


def is_audit_failure(exc: BaseException | None) -> bool:
    """The exception is (or was caused by) the audit log being unwritable."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, AuditWriteError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class QuietAuditFailures(logging.Filter):
    """On the log handlers: a record whose exception is the audit log being unwritable is counted
    (in the next warning) instead of printed with its traceback."""

    _installed: QuietAuditFailures | None = None

    @classmethod
    def install(cls) -> None:
        if cls._installed is None:
            cls._installed = cls()
        for handler in logging.getLogger().handlers:
            if cls._installed not in handler.filters:
                handler.addFilter(cls._installed)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if record.exc_info and is_audit_failure(record.exc_info[1]):
                unwritable.note(record.exc_info[1], refused=False)
                return False
        except Exception:
            pass
        return True


def fail_closed(on_error: Callable[..., None]):
    """Wrap a hook; on any exception call `on_error(self, *hook_args, error=exc)` and never re-raise."""

    def decorate(hook):
        def handle(self, args, exc):
            if is_audit_failure(exc):
                # Known and expected while the disk is full: refused, counted, no traceback.
                unwritable.note(exc)
                try:
                    on_error(self, *args, error=exc)
                except Exception as again:
                    if not is_audit_failure(again):  # the fallback's own line cannot be written either
                        logger.critical("egress gateway: fallback for %s failed", hook.__qualname__, exc_info=True)
                return
            # The exception's type and location only: its message may quote sandbox input.
            logger.error("egress gateway: %s failed closed: %s", hook.__qualname__, type(exc).__name__, exc_info=exc)
            try:
                on_error(self, *args, error=exc)
            except Exception as again:  # the fallback must never let the flow continue either
                if is_audit_failure(again):
                    unwritable.note(again, refused=False)
                else:
                    logger.critical("egress gateway: fallback for %s failed", hook.__qualname__, exc_info=True)

        if inspect.iscoroutinefunction(hook):

            @functools.wraps(hook)
            async def async_wrapper(self, *args):
                try:
                    return await hook(self, *args)
                except Exception as exc:
                    handle(self, args, exc)

            return async_wrapper

        @functools.wraps(hook)
        def wrapper(self, *args):
            try:
                return hook(self, *args)
            except Exception as exc:
                handle(self, args, exc)

        return wrapper

    return decorate
