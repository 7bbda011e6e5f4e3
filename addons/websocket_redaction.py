"""WebSocket frames to the sandbox of a credential-bound flow, redacted as bytes (a patch of
mitmproxy's WebsocketLayer, addons/patches.py); its messages are also redacted decoded, in
addons/response_redaction.py."""

from __future__ import annotations

from .credentials import BOUND


def install_websocket_redaction(get_redactor) -> None:
    """WebSocket control frames (ping/pong payloads, close reasons) pass no hook in mitmproxy.
    Server-to-client frames are unmasked, so redacting the bytes sent to the client (length-
    preserving) covers them; messages are also redacted decoded, in `websocket_message`."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers import websocket as ws_module

    if getattr(ws_module.WebsocketLayer, "_egress_redacting", False):
        ws_module.WebsocketLayer._egress_get_redactor = staticmethod(get_redactor)
        return

    class RedactingWebsocketLayer(ws_module.WebsocketLayer):
        _egress_redacting = True
        _egress_get_redactor = staticmethod(get_redactor)

        def handle_event(self, event):
            redactor = self._egress_get_redactor()
            for command in super().handle_event(event):
                if redactor is not None:
                    if (isinstance(command, commands.SendData) and command.connection == self.context.client
                            and BOUND in self.flow.metadata):
                        command.data, _ = redactor.redact(command.data)
                    elif isinstance(command, commands.Log):
                        command.message, _ = redactor.redact_text(command.message)
                yield command

    ws_module.WebsocketLayer = RedactingWebsocketLayer
