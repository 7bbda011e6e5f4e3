"""Per-connection classes learn their attribute names before there are many of their instances.

CPython 3.12 keeps an instance's attributes inline, in an array of the class's shared keys, while
the name being set is one of them; a name the class has not seen yet can join the shared keys only
while there is room, and the room shrinks by one with every instance made (from 30). A name first
set after ~30 instances exist, such as one set late in a connection's life (a stream's flow, its
buffer accounts, a layer's decided child, the sandbox's mark on a connection handler), no longer
fits: every instance that sets it gets a dict of its own, 464-1,584 bytes instead of ~8 bytes a
name. Under a burst of connections that is every instance: an open SSE stream carried eight such
dicts, ~6 KB (docs/performance.md, "Memory per open SSE stream"). Which classes were hit depended on
what the process happened to do first.

Here, before the first connection, one throw-away instance of each such class (made without its
constructor: nothing runs) is given every name its instances will get: its source's `self.NAME =`
assignments over the class and its bases (from their bytecode), and the names other modules set
on it. The names then
stay in the shared keys, and every instance keeps them inline. Nothing about the objects changes
but where their attributes are stored. A class with more names than the shared keys hold is left
as it is (its instances get dicts either way).
"""

from __future__ import annotations

import dis
import types
from functools import cache

SHARED_KEYS_MAX = 30  # CPython 3.12's SHARED_KEYS_MAX_SIZE: names a class's instances can keep inline
_TAUGHT: set[type] = set()


def _stored_names(code: types.CodeType, me: str) -> set[str]:
    """The names `code` (and the functions nested in it) stores on `me`: `me.NAME = ...` (also in
    tuples) and `me.NAME += ...`, read from its bytecode (CPython 3.12's)."""
    names: set[str] = set()
    ops = list(dis.get_instructions(code))
    loads_me = lambda op: op.opname in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF") and op.argval == me  # noqa: E731
    for i, op in enumerate(ops):
        if op.opname != "STORE_ATTR" or not i:
            continue
        if loads_me(ops[i - 1]):  # me.NAME = value
            names.add(op.argval)
        elif ops[i - 1].opname == "SWAP":  # me.NAME += value: LOAD me, COPY 1, LOAD_ATTR NAME, ..., SWAP 2
            names.update(op.argval for j in range(2, i) if ops[j].opname == "LOAD_ATTR"
                         and ops[j].argval == op.argval and ops[j - 1].opname == "COPY" and loads_me(ops[j - 2]))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_names(const, me)
    return names


@cache
def _assigned_names(klass: type) -> frozenset[str]:
    """Every `self.NAME` that the class's own methods assign. From their bytecode: reading and parsing
    the sources left ~1 MiB of the process's memory behind."""
    names: set[str] = set()
    for value in vars(klass).values():
        functions = (value.fget, value.fset) if isinstance(value, property) else (getattr(value, "__func__", value),)
        for function in functions:
            code = getattr(function, "__code__", None)
            if code is not None and code.co_argcount:
                names |= _stored_names(code, code.co_varnames[0])
    return frozenset(names)


def attribute_names(cls: type, also: tuple[str, ...] = ()) -> list[str]:
    """The names instances of `cls` get: assigned in its methods or its bases', and `also`."""
    names = set(also)
    for klass in cls.__mro__[:-1]:
        names |= _assigned_names(klass)
    return sorted(names)


def teach(cls: type, names: list[str]) -> bool:
    """Make `names` shared keys of `cls` (see the module's docstring); False if they cannot all be."""
    if len(names) > SHARED_KEYS_MAX or not hasattr(cls, "__dict__"):
        return False
    probe = cls.__new__(cls)
    for name in names:
        try:
            object.__setattr__(probe, name, None)
        except (AttributeError, TypeError):  # a property or slot of that name: not an instance attribute
            pass
    return True


def install() -> None:
    from mitmproxy.proxy.layer import NextLayer
    from mitmproxy.proxy.layers.tls import ClientTLSLayer, ServerTLSLayer
    from mitmproxy.proxy.mode_servers import ProxyConnectionHandler

    from . import fair_share, write_backlog
    from .http1_server import GatewayHttp1Server
    from .layers import GatewayHttpLayer, GatewayHttpStream, _TargetFormStream

    stream_extras = ("on_refusal", "body_limits", "mode")  # set by GatewayHttpLayer.make_stream
    handler_extras = (fair_share.ATTR, "_egress_spent", "_egress_light", "_egress_small_reads",  # (addons/channels.py)
                      write_backlog.ATTR, write_backlog.ATTR + "_task")
    for cls, also in ((NextLayer, ()), (ServerTLSLayer, ()), (ClientTLSLayer, ()), (GatewayHttpLayer, ()),
                      (GatewayHttp1Server, ()), (GatewayHttpStream, stream_extras),
                      (_TargetFormStream, stream_extras), (ProxyConnectionHandler, handler_extras)):
        if cls not in _TAUGHT:  # (once per process, even when the addons are made again)
            teach(cls, attribute_names(cls, also))
            _TAUGHT.add(cls)
