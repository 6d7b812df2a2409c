"""Hand-made HTTP/1.1 over a raw socket, for clients no library would be:
half-sent bodies, stalled senders, readers that never read."""

from __future__ import annotations

import json
import socket


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    """A TCP connection to the server at ``url`` (http://127.0.0.1:PORT); rcvbuf: a small receive window."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: it sets the window
    s.connect((host, int(port)))
    return s


def request_head(path: str, length: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def send_half(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """A connection that has sent its headers and half its body, and then nothing."""
    raw = json.dumps(body).encode()
    s = connect(url)
    s.sendall(request_head(path, len(raw), headers) + raw[: len(raw) // 2])
    return s


def read_response(s: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a response with a Content-Length, read whole."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return int(status_line.split()[1]), headers, body
