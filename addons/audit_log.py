"""The audit log's one owner: its options, opening, configuring, rotating, reopening on SIGHUP,
its due refusal summaries and retries, and closing.

- `egress_audit_log` opens it (a path, '-' for stdout, empty for none; a worker of `run --workers
  N` gets the supervisor's pipe as 'fd:N');
- `egress_audit_chain`, `egress_audit_max_bytes`, `egress_audit_backups`, the line size and the
  refusal line budgets configure it; the scrubber takes every secret the policy declares out of
  every value before a line is written;
- once a second it writes the refusal summaries that are due and retries a log that failed (the
  other addons read `state.audit.writable`: /readyz says so, and so does a metric).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from mitmproxy import ctx, exceptions

from gateway.audit import PipeAuditLog, open_audit_log
from gateway.workers import worker_index

from .heartbeat import every_second
from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")

AUDIT_OPTIONS = frozenset({
    "egress_audit_log", "egress_audit_chain", "egress_audit_max_bytes", "egress_audit_backups",
    "egress_audit_max_refusals_per_second_per_sandbox", "egress_audit_max_refusals_per_second_per_key",
    "egress_audit_max_refusals_per_second", "egress_audit_max_line_bytes",
})


class SecretScrubber:
    """AuditLog.scrub: replaces every form of every secret the policy declares (as response
    redaction does) in string values of an audit record. Secret *names* ("injected", "secret") stay.
    Costs nothing when the policy has no secrets."""

    NAME_KEYS = frozenset({"time", "event", "injected", "secret"})

    def __init__(self, state: GatewayState):
        self.state = state

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        redactor = self.state.redactor()  # the response redactor's: every value held, past ones too
        if redactor is None:
            return values
        return {k: v if k in self.NAME_KEYS else self._clean(redactor, v) for k, v in values.items()}

    @classmethod
    def _clean(cls, redactor, value: Any) -> Any:
        if isinstance(value, str):
            return redactor.redact_text(value)[0]
        if isinstance(value, (list, tuple)):
            return [cls._clean(redactor, v) for v in value]
        return value


class AuditLogOwner:
    name = "egressauditlog"

    def __init__(self, state: GatewayState):
        self.state = state
        self.scrubber = SecretScrubber(state)
        state.signals.subscribe(signal.SIGHUP, self.reopen)
        self._task: asyncio.Task | None = None

    def load(self, loader):
        declare(
            loader,
            "egress_audit_log",
            "egress_audit_chain",
            "egress_audit_max_bytes",
            "egress_audit_backups",
            "egress_audit_max_refusals_per_second_per_sandbox",
            "egress_audit_max_refusals_per_second_per_key",
            "egress_audit_max_line_bytes",
            "egress_audit_max_refusals_per_second",
        )

    def configure(self, updated: set[str]):
        if "egress_audit_log" in updated:
            self._open(ctx.options.egress_audit_log or None)
        if updated & AUDIT_OPTIONS:
            self._configure()

    def _open(self, target: str | None) -> None:
        self.state.audit.close()
        try:
            self.state.audit = open_audit_log(target)
        except OSError as exc:
            raise exceptions.OptionsError(f"cannot open audit log {target}: {exc.strerror}") from None

    def _configure(self) -> None:
        max_bytes = ctx.options.egress_audit_max_bytes
        backups = ctx.options.egress_audit_backups
        if max_bytes < 0:
            raise exceptions.OptionsError("egress_audit_max_bytes must be >= 0")
        if backups < 1:
            raise exceptions.OptionsError("egress_audit_backups must be >= 1")
        per_sandbox = ctx.options.egress_audit_max_refusals_per_second_per_sandbox
        per_key = ctx.options.egress_audit_max_refusals_per_second_per_key
        total = ctx.options.egress_audit_max_refusals_per_second
        if per_sandbox < 0 or per_key < 0 or total < 0:
            raise exceptions.OptionsError("egress_audit_max_refusals_per_second(_per_sandbox, _per_key) must be >= 0")
        line_bytes = ctx.options.egress_audit_max_line_bytes
        if line_bytes < 2048:
            raise exceptions.OptionsError("egress_audit_max_line_bytes must be >= 2048")
        audit = self.state.audit
        audit.max_line_bytes = line_bytes
        if audit.target == "-" and max_bytes == ctx.options.default("egress_audit_max_bytes"):
            max_bytes = 0  # rotation is on by default for files; stdout cannot rotate
        if max_bytes and audit.target == "-":
            raise exceptions.OptionsError("audit log rotation (egress_audit_max_bytes) needs a file, not stdout")
        audit.configure(chain=ctx.options.egress_audit_chain, max_bytes=max_bytes, backups=backups,
                        scrub=self.scrubber, refusals_per_second=per_sandbox, refusals_per_key=per_key or per_sandbox,
                        refusals_total=total)

    def running(self):
        self._task = every_second(lambda: self.state.audit.maintain(), "audit log maintenance")
        audit = self.state.audit
        if isinstance(audit, PipeAuditLog):
            logger.info("egress gateway: audit lines go to the supervisor (worker %s)", worker_index())
        elif audit.target:
            extras = [f"rotated at {audit.max_bytes} bytes, {audit.backups} kept" if audit.max_bytes else "",
                      "hash-chained" if audit.chain else ""]
            extra = ", ".join(e for e in extras if e)
            logger.info("egress gateway: audit log %s%s", "stdout" if audit.target == "-" else audit.target,
                        f" ({extra})" if extra else "")

    def reopen(self) -> None:
        """SIGHUP: after logrotate moved the file, write to a new one at the same path."""
        audit = self.state.audit
        audit.reopen()
        if audit.target not in (None, "-") and not isinstance(audit, PipeAuditLog):
            logger.info("egress gateway: audit log %s reopened", audit.target)

    def done(self):
        if self._task is not None:
            self._task.cancel()
        head = self.state.audit.head
        self.state.audit.close()
        if head is not None:
            logger.info("egress gateway: audit chain head %s", head)
