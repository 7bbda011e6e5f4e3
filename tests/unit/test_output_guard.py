"""addons/output_guard.py without a proxy: every flow writer mitmproxy 12.3 has is forced off, the
printer's levels are capped, and the view the printer gets holds no form of a secret."""

from __future__ import annotations

import io

import pytest
from mitmproxy import exceptions, hooks
from mitmproxy.addons import (clientplayback, dumper, readfile, save, savehar, serverplayback, stickyauth, termlog,
                              view)
from mitmproxy.test import taddons, tflow

from addons.output_guard import FORCED_OFF, OutputGuard, redacted_view
from gateway.redact import Redactor

SECRET = "ug-Secret+Value/With=Signs&x y"


def _guard(secret: str = SECRET) -> OutputGuard:
    redactor = Redactor({"tok": secret})
    return OutputGuard(lambda: redactor)


def _writers():
    return [save.Save(), savehar.SaveHar(), readfile.ReadFile(), clientplayback.ClientPlayback(),
            serverplayback.ServerPlayback(), stickyauth.StickyAuth()]


def test_the_table_names_every_option_that_writes_or_replays_flows():
    assert set(FORCED_OFF) == {"save_stream_file", "hardump", "rfile", "client_replay", "server_replay",
                               "stickyauth", "proxy_debug"}


def test_flow_writers_are_forced_off_at_start_and_later(tmp_path, caplog):
    guard = _guard()
    with taddons.context(*_writers(), guard) as tctx:
        tctx.options.update(save_stream_file=str(tmp_path / "flows"), hardump=str(tmp_path / "h.har"),
                            stickyauth=".")
        assert tctx.options.save_stream_file is None
        assert tctx.options.hardump == ""
        assert tctx.options.stickyauth is None
        assert tctx.options.rfile is None and tctx.options.client_replay == [] and tctx.options.server_replay == []
    assert "ignoring save_stream_file=" in caplog.text and "ignoring stickyauth='.'" in caplog.text
    assert not (tmp_path / "flows").exists() or not (tmp_path / "flows").read_bytes()


def test_printer_level_and_terminal_log_are_capped():
    out = io.StringIO()
    with taddons.context(dumper.Dumper(out), termlog.TermLog(io.StringIO()), _guard()) as tctx:
        tctx.options.update(flow_detail=4, termlog_verbosity="debug")
        assert tctx.options.flow_detail == 2
        assert tctx.options.termlog_verbosity == "info"
        tctx.options.update(flow_detail=1)
        assert tctx.options.flow_detail == 1


def test_the_printer_sees_a_redacted_view():
    out = io.StringIO()
    printer = dumper.Dumper(out)
    with taddons.context(printer, _guard()) as tctx:
        tctx.options.update(flow_detail=2)
        f = tflow.tflow(resp=True)
        f.request.headers["Authorization"] = f"Bearer {SECRET}"
        f.request.query["api_key"] = SECRET
        f.request.trailers = None
        f.response.headers["X-Echo"] = SECRET
        f.response.reason = f"nope {SECRET}"
        printer.response(f)
        f.error = tflow.terr(f"upstream said {SECRET}")
        printer.error(f)
    text = out.getvalue()
    assert "Bearer [REDACTED]" in text and "api_key=[REDACTED]" in text
    assert SECRET not in text and "Secret+Value" not in text and "Secret%2BValue" not in text
    # the flow itself is untouched: it still goes upstream with its credential
    assert f.request.headers["Authorization"] == f"Bearer {SECRET}"


def test_view_of_a_websocket_flow():
    f = tflow.twebsocketflow()
    f.websocket.close_reason = f"bye {SECRET}"
    f.websocket.messages[-1].content = SECRET.encode()
    view = redacted_view(f, Redactor({"tok": SECRET}))
    assert SECRET not in view.websocket.close_reason
    assert SECRET.encode() not in view.websocket.messages[-1].content
    assert f.websocket.close_reason == f"bye {SECRET}"


def test_refuses_interactive_masters():
    guard = _guard()
    with taddons.context(guard):
        assert guard.refused is None  # a TestMaster, no flow view: allowed
    guard = _guard()
    with taddons.context(view.View()) as tctx:
        with pytest.raises(exceptions.OptionsError, match="interactive UI"):
            tctx.master.addons.invoke_addon_sync(guard, hooks.ConfigureHook(set()))
    assert guard.refused is not None
    f = tflow.tflow()
    guard.requestheaders(f)
    assert f.error is not None  # killed
