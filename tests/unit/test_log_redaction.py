"""addons/log_redaction.py: no secret reaches a log line, whatever part of a record carries it.

A real handler and formatter print each record. The secret sits in the message, in the exception's
own text, in an exception it chains (`raise ... from`, or raised while handling another), in a note,
in an exception group's member, or in the stack. The line keeps the rest of its traceback (what the
operator needs), with the secret replaced."""

from __future__ import annotations

import io
import logging

import pytest

from addons.log_redaction import LogRedaction
from gateway.redact import Redactor

SECRET = "sEcReT-LogRedaction-0123456789abcdef"


@pytest.fixture(params=["logging", "mitmproxy"])
def printed(request):
    """Log through a real handler with the filter (Python's formatter, and mitmproxy's, which prints
    a record's exc_info but never its exc_text); returns what the handler printed."""
    from mitmproxy.log import MitmFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s") if request.param == "logging"
                         else MitmFormatter(colorize=False))
    handler.addFilter(LogRedaction(lambda: Redactor({"api_token": SECRET})))
    logger = logging.getLogger("test.log_redaction")
    logger.propagate = False
    logger.addHandler(handler)
    yield logger, stream
    logger.removeHandler(handler)


def _raises(kind: str):
    if kind == "message":
        raise ValueError(f"bad header Bearer {SECRET}")
    if kind == "cause":
        try:
            raise KeyError(f"Authorization: Bearer {SECRET}")
        except KeyError as inner:
            raise RuntimeError("lookup failed") from inner
    if kind == "context":
        try:
            raise KeyError(f"Authorization: Bearer {SECRET}")
        except KeyError:
            raise RuntimeError("while handling it, another failure")
    if kind == "note":
        error = RuntimeError("a clean message")
        error.add_note(f"request had Authorization: Bearer {SECRET}")
        raise error
    if kind == "group":
        raise ExceptionGroup("two failures", [ValueError("fine"), ValueError(f"token {SECRET}")])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["message", "cause", "context", "note", "group"])
def test_a_secret_anywhere_in_an_exception_is_not_printed(printed, kind):
    logger, stream = printed
    try:
        _raises(kind)
    except BaseException:
        logger.error("mitmproxy has crashed!", exc_info=True)
    out = stream.getvalue()
    assert SECRET not in out, out
    assert "mitmproxy has crashed!" in out and "Traceback (most recent call last)" in out, out
    assert "_raises" in out  # the traceback itself is kept, only the secret is replaced


def test_a_secret_in_the_message_or_the_stack_is_not_printed(printed):
    logger, stream = printed
    logger.warning("upstream sent %s", f"Bearer {SECRET}", stack_info=True)
    out = stream.getvalue()
    assert SECRET not in out and "upstream sent" in out, out


def test_after_mitmproxy_s_handlers_are_gone_python_s_last_resort_is_filtered_too(monkeypatch):
    """mitmproxy's `done` takes its handlers off the root logger; Python then prints WARNING and
    above through logging.lastResort."""
    stream = io.StringIO()
    last_resort = logging.StreamHandler(stream)
    last_resort.setLevel(logging.WARNING)
    monkeypatch.setattr(logging, "lastResort", last_resort)
    monkeypatch.setattr(LogRedaction, "_installed", None)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    LogRedaction.install(lambda: Redactor({"api_token": SECRET}))
    logging.getLogger("test.after_done").warning("late line: Bearer %s", SECRET)
    out = stream.getvalue()
    assert "late line" in out and SECRET not in out, out


def test_a_clean_record_is_printed_as_it_was(printed):
    logger, stream = printed
    try:
        raise RuntimeError("nothing secret here")
    except RuntimeError:
        logger.error("a failure", exc_info=True)
    out = stream.getvalue()
    assert "nothing secret here" in out and "a failure" in out


def test_a_redactor_that_fails_withholds_the_line(printed):
    logger, stream = printed
    handler = logger.handlers[0]
    handler.filters[0].get_redactor = lambda: 1 / 0
    try:
        _raises("message")
    except ValueError:
        logger.error(f"Bearer {SECRET}", exc_info=True)
    out = stream.getvalue()
    assert SECRET not in out and "withheld" in out, out
