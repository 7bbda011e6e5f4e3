"""This thread in another network namespace for the length of a block: sockets made there stay
there for life. One helper for every suite that makes namespaces (tests/support/topology.py,
tests/netns/lab.py, tests/deploy/podman.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def thread_inside(path: Path):
    """Run the block with this thread in the namespace at `path` (e.g. /run/netns/NAME), and back in
    its own after; checked to have taken before the block runs, so that no socket of the block is
    made in the host's namespace by mistake."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        os.setns(target, os.CLONE_NEWNET)
        try:
            here, there = os.stat("/proc/thread-self/ns/net"), os.stat(path)
            if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
                raise AssertionError(f"refusing to open a socket outside namespace {path}")
            yield
        finally:
            os.setns(own, os.CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)
