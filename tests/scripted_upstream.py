"""A real TCP server on loopback that answers with scripted raw bytes, to play backends that
misbehave in ways a well-behaved HTTP server cannot (cut events, bad headers, trickling bytes).

The script is chosen by the `model` of the request body, so one server serves every case.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable

Script = Callable[[socket.socket], None]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _read_request(sock: socket.socket) -> dict[str, object]:
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            return {}
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += sock.recv(65536)
    parsed: dict[str, object] = json.loads(body or b"{}")
    return parsed


class ScriptedUpstream:
    def __init__(self, scripts: dict[str, Script]) -> None:
        scripts_by_model = scripts

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                request = _read_request(sock)
                script = scripts_by_model.get(str(request.get("model")))
                if script is not None:
                    script(sock)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def trickle(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Send one byte at a time, stopping quietly once the peer has gone."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return
        time.sleep(every_s)
