"""Fail closed: mitmproxy logs and ignores exceptions raised in hooks, which would let the flow
through. Every decision hook is wrapped so that an exception becomes a refusal instead."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

logger = logging.getLogger("egress.failclosed")


def fail_closed(on_error: Callable[..., None]):
    """Wrap a hook; on any exception call `on_error(self, *hook_args, error=exc)` and never re-raise."""

    def decorate(hook):
        def handle(self, args, exc):
            # The exception's type and location only: its message may quote sandbox input.
            logger.error("egress gateway: %s failed closed: %s", hook.__qualname__, type(exc).__name__, exc_info=exc)
            try:
                on_error(self, *args, error=exc)
            except Exception:  # the fallback must never let the flow continue either
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
