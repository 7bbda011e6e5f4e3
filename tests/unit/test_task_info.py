"""addons/task_info.py: the tasks mitmproxy starts keep their names and no debug attributes (an
instance dict each, for the life of a connection). Nothing in the gateway reads those attributes:
the only reader, mitmproxy's SIGUSR1 dump, is never registered here. mitmproxy's code this relies on
(its create_task and set_current_task_debug_info looking the function up in their module) is pinned
by hash."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
from pathlib import Path

from mitmproxy.utils import asyncio_utils

from addons import task_info

task_info.install()

ROOT = Path(__file__).resolve().parents[2]
# sha256 of mitmproxy 12.3's functions in mitmproxy/utils/asyncio_utils.py
MITMPROXY = {
    "create_task": "18c03f6f52c5c6413ad9edd534ed8dffbba640ec297d06e3a26d46f33fa0422e",
    "set_task_debug_info": "40112e6fb1b60d2fe03c02a3f2b6b03bcfb3e760eed1337689ee79845103acc7",
    "set_current_task_debug_info": "d16ca08ec45e79ba5a64026c5b7aab29f3a74a32561c57260790733b9bbd00ce",
}


def test_mitmproxy_s_task_helpers_are_the_ones_this_was_written_for():
    source = inspect.getsource(asyncio_utils)
    found = {node.name: hashlib.sha256(ast.get_source_segment(source, node).encode()).hexdigest()
             for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in MITMPROXY}
    assert found == MITMPROXY, "mitmproxy's asyncio_utils changed: check addons/task_info.py, then update the hashes"


def test_a_task_keeps_its_name_and_no_debug_attributes():
    async def main():
        async def work():
            asyncio_utils.set_current_task_debug_info(name="client handler", client=("127.0.0.9", 1))
            await asyncio.sleep(0)  # (a step of the loop: not synchronisation)

        task = asyncio_utils.create_task(work(), name="server connection handler ('127.0.0.1', 443)",
                                         keep_ref=False, client=("127.0.0.9", 1))
        assert task.get_name() == "server connection handler ('127.0.0.1', 443)"
        await task
        assert task.get_name() == "client handler"
        assert not hasattr(task, "created") and not hasattr(task, "client")

    asyncio.run(main())


def test_nothing_in_the_gateway_reads_them_or_registers_mitmproxy_s_dump():
    readers = []
    for path in [*ROOT.glob("addons/*.py"), *ROOT.glob("gateway/**/*.py")]:
        if path.name == "task_info.py":
            continue  # (it names them to say why they go)
        text = path.read_text()
        if "register_info_dumpers" in text or "task_repr" in text or "dump_info" in text:
            readers.append(str(path.relative_to(ROOT)))
    assert readers == [], "a task's debug attributes are read here now: addons/task_info.py drops them"
