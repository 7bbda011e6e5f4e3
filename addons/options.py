"""Options are declared from one table (gateway/options.py): an addon names the rows it owns."""

from __future__ import annotations

from gateway.options import OPTIONS


def declare(loader, *names: str) -> None:
    """In an addon's `load`: add these rows of the table as mitmproxy options."""
    for name in names:
        option = OPTIONS[name]
        loader.add_option(option.name, option.type, option.default, option.help)
