"""Hot reload of the policy file: on change (polled) and on SIGHUP.

The file is stat()ed every `egress_policy_poll` seconds; `os.stat` follows symlinks, so a
Kubernetes ConfigMap update (the `..data` symlink swapped to a new directory) is a change like
any other. A valid new version is compiled into a new engine and swapped in with one assignment
(each request is judged by the old or the new policy, never a mix; requests on kept-alive
connections are judged by the policy current when they arrive), and every open connection is judged
again by it: what it no longer allows is closed (addons/revocation.py). An invalid one is rejected with
the same message `egress-gateway check` prints, logged, recorded (`event: policy_reload`,
`result: error`), and the old policy stays.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from pathlib import Path

from mitmproxy import ctx

from gateway.decision import Decision, verdict_fields
from gateway.policy import PolicyError, compile_policy

from .options import declare
from .state import GatewayState

logger = logging.getLogger("egress")


class PolicyReloader:
    def __init__(self, state: GatewayState, build_engine):
        self.state = state
        self.build_engine = build_engine
        self._task: asyncio.Task | None = None
        self._identity: tuple | None = None
        self._lock = asyncio.Lock()

    def load(self, loader):
        declare(loader, "egress_policy_poll")

    def running(self):
        path = ctx.options.egress_policy
        if not path:
            return  # the embedded default policy never changes
        self._identity = self._stat(path)
        self.state.signals.subscribe(signal.SIGHUP, self.reload_now)
        if ctx.options.egress_policy_poll > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def done(self):
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @staticmethod
    def _stat(path: str) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    async def _poll(self) -> None:
        first = True
        while True:
            # Even the first look waits one interval: a rejected reload logs an error, and an error
            # logged while mitmproxy is still starting makes it exit.
            await asyncio.sleep(max(ctx.options.egress_policy_poll, 1))
            try:
                identity = self._stat(ctx.options.egress_policy)
                # The first look compares content, not identity: the file may have changed between
                # the start-up load and `running` (where the identity was taken), and that change
                # would otherwise wait for the next one.
                if first or identity != self._identity:
                    await self.reload_now()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("egress gateway: policy watcher failed; the current policy stays")
            first = False

    async def reload_now(self) -> bool:
        """Reload if the file's content changed; True when a new policy was installed."""
        async with self._lock:
            path = ctx.options.egress_policy
            self._identity = self._stat(path)
            current = self.state.engine.policy if self.state.engine else None
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                self._rejected(f"cannot read policy {path}: {exc}")
                return False
            if current is not None and hashlib.sha256(text.encode("utf-8")).hexdigest() == current.sha256:
                return False
            try:
                policy = compile_policy(text, path)
                engine = self.build_engine(policy)
            except PolicyError as exc:
                self._rejected(str(exc))
                return False
            logger.info("egress gateway: policy %s reloaded (sha256 %s, %d rules)", path, policy.sha256, len(policy.rules))
            reloaded = Decision(True, "policy_reloaded", f"policy {path} reloaded ({len(policy.rules)} rules)")
            # The line first, then the swap: installing judges every open connection again
            # (addons/revocation.py), and their `revoked` lines follow the reload that caused them.
            # Nothing runs in between (no await), so no request is judged in the gap. The swap
            # happens even when the line cannot be written (a full disk): the poller has taken the
            # file's new identity, so a lost install would be lost for good.
            try:
                self.state.record(event="policy_reload", **verdict_fields(reloaded), result="ok",
                                  sha256=policy.sha256)
            finally:
                self.state.install(engine)
            return True

    def _rejected(self, why: str) -> None:
        logger.error("egress gateway: policy reload rejected, the current policy stays:\n%s", why)
        rejected = Decision(False, "policy_invalid", f"reload rejected: {why[:1500]}")
        self.state.record(event="policy_reload", **verdict_fields(rejected), result="error")
