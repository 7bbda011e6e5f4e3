"""addons/hook_dispatch.py: an event reaches the addons that implement its hook, in chain order,
with mitmproxy's semantics (an exception is logged and the next addon runs, AddonHalt stops the
event, an awaitable is awaited before the next addon), and the plan follows every change: addons
added or reordered, a hook rebound while options change, children of an addon, a hook set on an
instance. The mitmproxy code it stands in for is the code this mitmproxy has."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging

from mitmproxy import addonmanager, exceptions, hooks
from mitmproxy.test import taddons, tflow

from addons import hook_dispatch

hook_dispatch.install()

# sha256 of mitmproxy 12.3's code that the plan replaces for planned events: trigger_event walks the
# chain, invoke_addon and _iter_hooks call each handler, traverse finds children, safecall logs.
MITMPROXY_ARGS = "5bab95f7aa358e18cbc06abdb02a4d0a1e71274032d765285706a54e5cb2d965"  # Hook.args
MITMPROXY_DISPATCH = "57b156773e6636140877b38f207aa842fc7e2be3a85c4302c9e17e58f180f2f8"


class Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def request(self, flow):
        self.log.append((self.name, flow))


class Slow(Recorder):
    async def request(self, flow):
        await asyncio.sleep(0)
        self.log.append((self.name, flow))


class Failing(Recorder):
    def request(self, flow):
        self.log.append((self.name, flow))
        raise ValueError("boom")


class Halting(Recorder):
    def request(self, flow):
        self.log.append((self.name, flow))
        raise exceptions.AddonHalt()


class Silent:
    """Implements no hook of interest."""

    def response(self, flow):
        pass


def dispatch(tctx, flow) -> None:
    asyncio.run(tctx.master.addons.trigger_event(hooks.all_hooks["request"](flow)))


def names(log: list) -> list[str]:
    return [name for name, _ in log]


def test_handlers_run_in_chain_order_with_the_event_arguments_and_async_ones_awaited():
    log: list = []
    flow = tflow.tflow()
    with taddons.context(Recorder("a", log), Silent(), Slow("b", log), Recorder("c", log)) as tctx:
        dispatch(tctx, flow)
        dispatch(tctx, flow)
    assert names(log) == ["a", "b", "c"] * 2
    assert all(f is flow for _, f in log)


def test_an_exception_is_logged_and_the_next_addon_still_runs(caplog):
    log: list = []
    with taddons.context(Failing("a", log), Recorder("b", log)) as tctx:
        with caplog.at_level(logging.ERROR):
            dispatch(tctx, tflow.tflow())
    assert names(log) == ["a", "b"]
    assert "Addon error: boom" in caplog.text


def test_addon_halt_stops_the_event():
    log: list = []
    with taddons.context(Recorder("a", log), Halting("h", log), Recorder("b", log)) as tctx:
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["a", "h"]


def test_addons_added_or_reordered_after_a_dispatch_are_followed():
    log: list = []
    first, second = Recorder("a", log), Recorder("b", log)
    with taddons.context(first) as tctx:
        dispatch(tctx, tflow.tflow())
        tctx.master.addons.add(second)
        dispatch(tctx, tflow.tflow())
        chain = tctx.master.addons.chain
        chain[:] = [second] + [a for a in chain if a is not second]
        dispatch(tctx, tflow.tflow())
        tctx.master.addons.remove(first)
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["a", "a", "b", "b", "a", "b"]


class Rebinding:
    """Rebinds its hook when an option changes, as addons/output_guard.py rebinds the dumper's."""

    def __init__(self, log: list):
        self.log = log

    def request(self, flow):
        self.log.append(("original", flow))

    def configure(self, updated):
        if "upstream_cert" in updated:
            self.request = lambda flow: self.log.append(("rebound", flow))


def test_a_hook_rebound_when_an_option_changes_is_the_one_called():
    log: list = []
    with taddons.context(Rebinding(log)) as tctx:
        dispatch(tctx, tflow.tflow())
        tctx.options.update(upstream_cert=not tctx.options.upstream_cert)
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["original", "rebound"]


def test_a_hook_on_the_instance_is_looked_up_at_every_event():
    log: list = []
    addon = Silent()
    addon.request = lambda flow: log.append(("first", flow))
    with taddons.context(addon) as tctx:
        dispatch(tctx, tflow.tflow())
        addon.request = lambda flow: log.append(("second", flow))
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["first", "second"]


class Parent:
    """An addon with children that change (as mitmproxy's script loader's scripts do)."""

    def __init__(self):
        self.addons: list = []


def test_the_children_of_an_addon_are_looked_up_at_every_event():
    log: list = []
    parent = Parent()
    with taddons.context(parent) as tctx:
        dispatch(tctx, tflow.tflow())
        parent.addons.append(Recorder("child", log))
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["child"]


def test_the_replaced_mitmproxy_code_is_this_mitmproxys():
    source = "".join(inspect.getsource(f) for f in (
        addonmanager.traverse, addonmanager.safecall, addonmanager.AddonManager._iter_hooks,
        addonmanager.AddonManager.invoke_addon))
    original = inspect.getsource(addonmanager.AddonManager.trigger_event.__wrapped__)
    digest = hashlib.sha256((source + original).encode()).hexdigest()
    assert digest == MITMPROXY_DISPATCH, "mitmproxy's hook dispatch changed: check addons/hook_dispatch.py against it"


def test_a_hooks_arguments_are_its_fields_in_order():
    flow = tflow.tflow()
    assert hooks.all_hooks["request"](flow).args() == [flow]
    data = object()
    assert hooks.all_hooks["tls_clienthello"](data).args() == [data]
    assert hooks.UpdateHook([flow]).args() == [[flow]]
    source = inspect.getsource(hooks.Hook.args.__wrapped__)
    assert hashlib.sha256(source.encode()).hexdigest() == MITMPROXY_ARGS, "mitmproxy's Hook.args changed"


class BadLookup:
    """An addon whose hooks cannot even be looked up (review 29)."""

    def __getattr__(self, name):
        if name == "request":
            raise RuntimeError("no lookup")
        raise AttributeError(name)


def test_an_addon_whose_hook_lookup_raises_fails_alone_and_the_others_still_run(caplog):
    log: list = []
    with taddons.context(Recorder("a", log), BadLookup(), Recorder("c", log)) as tctx:
        with caplog.at_level(logging.ERROR):
            dispatch(tctx, tflow.tflow())
            dispatch(tctx, tflow.tflow())
    assert names(log) == ["a", "c", "a", "c"]


class EqualToAll(Recorder):
    def __eq__(self, other):
        return isinstance(other, EqualToAll)

    __hash__ = object.__hash__


def test_an_addon_replaced_by_an_equal_one_is_followed():
    """The chain is compared by identity (review 29: an equal replacement kept the old one called)."""
    log: list = []
    old, new = EqualToAll("old", log), EqualToAll("new", log)
    with taddons.context(old) as tctx:
        dispatch(tctx, tflow.tflow())
        chain = tctx.master.addons.chain
        chain[chain.index(old)] = new
        dispatch(tctx, tflow.tflow())
    assert names(log) == ["old", "new"]


_BINDS_AT_RUN_TIME = r"""
import dis, json, types
from mitmproxy import hooks
from addons import egress, runner  # (every hook class the gateway dispatches is defined by now)

allowed = {"__init__", "load", "configure", "running", "done"}
hook_names = set(hooks.all_hooks)
found = []

def on_an_addon(target):  # self.X = ..., or another addon's (addons/output_guard.py: the dumper's)
    return target.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK") and (
        target.argval == "self" or "addon" in target.argval or "dumper" in target.argval)

def walk(code, where):
    ops = list(dis.get_instructions(code))
    for i, op in enumerate(ops):
        if (op.opname == "STORE_ATTR" and op.argval in hook_names and code.co_name not in allowed
                and i and on_an_addon(ops[i - 1])):
            found.append(f"{where}.{code.co_name} sets .{op.argval}")
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            walk(const, where)

classes = {type(addon) for addon in runner.builtin_addons() + egress.make_addons()}
for cls in classes:
    for klass in cls.__mro__[:-1]:
        for value in vars(klass).values():
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if code is not None:
                walk(code, klass.__qualname__)
print(json.dumps([len(classes), len(hook_names), found]))
"""


def test_no_addon_of_the_gateway_binds_a_hook_at_run_time():
    """A plan does not see a hook first bound on an instance after it was made (review 29), so no
    addon of the gateway's chain (its own and the mitmproxy ones it loads) may assign a hook's name
    to itself or another addon outside the moments that drop the plans: __init__ (before any
    event), load, configure (option changes), running and done. (In a child process: making the
    gateway's addons installs its patches of asyncio, which must not leak into the other tests.)"""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(hook_dispatch.__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _BINDS_AT_RUN_TIME], cwd=root, capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    classes, hook_names, found = json.loads(out.stdout.strip().splitlines()[-1])
    assert classes > 20 and hook_names > 40 and not found, found
