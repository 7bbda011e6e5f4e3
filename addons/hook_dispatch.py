"""mitmproxy's hook dispatch, with the handlers of each event looked up once instead of every time.

For every event of every flow (requestheaders, request, responseheaders, response, and an `update`
after each of them, tls_clienthello, server_connect, ...) mitmproxy 12.3's
`AddonManager.trigger_event` walks every addon in the chain: a generator over the addon and its
children, a `getattr` for the hook's name, a `safecall()` context manager and a coroutine per
addon, and `event.args()` (built with `dataclasses.fields`) again for every handler. The gateway's
runner has 37 addons and a keep-alive request fires eight such events, most of which two to nine
addons implement: that walk was ~31% of the gateway's CPU per keep-alive request (py-spy,
docs/performance.md, "CPU per request").

Here each AddonManager keeps a plan per event name: the chain's addons that implement the hook,
with the callable to call, in chain order. Dispatching an event then calls those callables one
after the other with the same arguments, with mitmproxy's semantics for each: an exception is
logged as `safecall()` logs it and the next addon still runs (the gateway's decision hooks catch
their own and deny: addons/failclosed.py), `AddonHalt` stops the event, `OptionsError` propagates,
an awaitable result is awaited before the next addon.

A plan holds what does not change while the chain and the options stay as they are: an addon with
children (`addons`: mitmproxy's script loader, whose scripts are reloaded) or whose hook is an
attribute of the instance rather than a method of its class (addons/output_guard.py rebinds the
dumper's) is looked up at every event, as mitmproxy does. The plans are dropped when the chain's
members (by identity) or order change, after any option changes (a `configure` may rebind a hook)
and after the lifecycle events (`running`, `done`), which are dispatched by mitmproxy's own code.
What a plan cannot see (review 29): a hook first set on an instance, children first given to an
addon, or a class's method patched, after the plan was made and outside those moments. No addon of
the gateway's does any of these (tests/unit/test_hook_dispatch.py checks that none binds a hook at
run time), and the patches of addons/patches.py are all installed before the first event. An addon
whose hook cannot even be looked up (a raising `__getattr__`) is looked up at every event, as
mitmproxy does, and only it fails: the others still run. Installed from addons/egress.py; tabled
in addons/patches.py.
"""

from __future__ import annotations

import dataclasses
import operator
import inspect
import sys
import types

from mitmproxy import addonmanager, exceptions, hooks

# Dispatched by mitmproxy's own trigger_event, and the plans dropped after them: an addon may
# (un)bind a hook while it starts or stops.
UNPLANNED = frozenset({"running", "done", "load", "configure"})
PLANS_ATTR = "_egress_hook_plans"


class _Plans:
    """The plans of one AddonManager, and the chain they were made for."""

    def __init__(self, manager: addonmanager.AddonManager) -> None:
        self.manager = manager
        self.chain: tuple = ()
        self.by_event: dict[str, tuple] = {}
        manager.master.options.changed.connect(self.drop)  # after AddonManager's own configure receiver

    def drop(self, *_args, **_kwargs) -> None:
        self.by_event = {}

    def get(self, name: str) -> tuple:
        chain = self.manager.chain
        if len(chain) != len(self.chain) or not all(map(operator.is_, chain, self.chain)):
            # (by identity: an addon replaced by an equal one is another addon; and an `__eq__`
            # that raised made every event raise. Compared in C: this runs for every event.)
            self.chain, self.by_event = tuple(chain), {}
        plan = self.by_event.get(name)
        if plan is None:
            plan = self.by_event[name] = tuple(_entry for a in chain if (_entry := _plan_entry(a, name)) is not None)
        return plan


def _plan_entry(addon, name: str):
    """(addon, callable) for a fixed handler, (addon, None) for one looked up at each event, or None.
    An addon whose lookup raises is looked up at each event: mitmproxy's own lookup then logs the
    error for that addon alone, and the rest of the event goes on (raised here, every event failed)."""
    try:
        return _fixed_entry(addon, name)
    except Exception:
        return addon, None


def _fixed_entry(addon, name: str):
    if hasattr(addon, "addons") or name in getattr(addon, "__dict__", ()):
        return addon, None
    func = getattr(addon, name, None)
    if not func or isinstance(func, types.ModuleType):
        return None  # mitmproxy skips an imported module that has a hook's name
    if not callable(func):
        return addon, None  # mitmproxy's own lookup logs its error at every event
    return addon, func


def _log_addon_error(exc: Exception) -> None:
    """What mitmproxy's safecall() logs for an exception raised in a hook."""
    tb = addonmanager.cut_traceback(exc.__traceback__, "invoke_addon_sync")
    tb = addonmanager.cut_traceback(tb, "invoke_addon")
    addonmanager.logger.error(f"Addon error: {exc}", exc_info=(type(exc), exc, tb))


def _field_names(cls) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in dataclasses.fields(cls))
    return names


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _install_args() -> None:
    """Hook.args with each hook class's field names looked up once: mitmproxy 12.3 calls
    `dataclasses.fields` for every call, and every event is asked for its arguments at least three
    times (the connection handler, handle_lifecycle, the dispatch). A dataclass's fields are fixed
    when its class is made."""
    Hook = hooks.Hook
    if getattr(Hook.args, "_egress_planned", False):
        return
    original = Hook.args

    def args(self) -> list:
        return [getattr(self, name) for name in _field_names(type(self))]

    args._egress_planned = True
    args.__wrapped__ = original
    Hook.args = args


def install() -> None:
    _install_args()
    AddonManager = addonmanager.AddonManager
    original = AddonManager.trigger_event
    if getattr(original, "_egress_planned", False):
        return

    async def trigger_event(self, event) -> None:
        """mitmproxy 12.3's trigger_event, walking the event's plan instead of the whole chain."""
        if event.name in UNPLANNED:
            try:
                return await original(self, event)
            finally:
                plans = self.__dict__.get(PLANS_ATTR)
                if plans is not None:
                    plans.drop()
        plans = self.__dict__.get(PLANS_ATTR)
        if plans is None:
            plans = self.__dict__[PLANS_ATTR] = _Plans(self)
        args = None
        for addon, func in plans.get(event.name):
            try:
                if func is None:
                    with addonmanager.safecall():
                        await self.invoke_addon(addon, event)
                    continue
                if args is None:
                    args = event.args()
                result = func(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                _log_addon_error(sys.exc_info()[1])

    trigger_event._egress_planned = True
    trigger_event.__wrapped__ = original  # what it stands in for (tests/unit/test_hook_dispatch.py)
    AddonManager.trigger_event = trigger_event
