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
assignments over the class and its bases, and the names other modules set on it. The names then
stay in the shared keys, and every instance keeps them inline. Nothing about the objects changes
but where their attributes are stored. A class with more names than the shared keys hold is left
as it is (its instances get dicts either way).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache

SHARED_KEYS_MAX = 30  # CPython 3.12's SHARED_KEYS_MAX_SIZE: names a class's instances can keep inline
_TAUGHT: set[type] = set()


@cache
def _assigned_names(klass: type) -> frozenset[str]:
    """Every `self.NAME` that the class's own methods assign (=, +=, annotated, in tuples)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
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
    handler_extras = (fair_share.ATTR, "_egress_spent", "_egress_light",  # (addons/channels.py)
                      write_backlog.ATTR, write_backlog.ATTR + "_task")
    for cls, also in ((NextLayer, ()), (ServerTLSLayer, ()), (ClientTLSLayer, ()), (GatewayHttpLayer, ()),
                      (GatewayHttp1Server, ()), (GatewayHttpStream, stream_extras),
                      (_TargetFormStream, stream_extras), (ProxyConnectionHandler, handler_extras)):
        if cls not in _TAUGHT:  # (once per process, even when the addons are made again)
            teach(cls, attribute_names(cls, also))
            _TAUGHT.add(cls)
