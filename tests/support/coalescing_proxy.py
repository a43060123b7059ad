"""A TCP proxy that hands a server's last answer and its close to the client at once.

What a client on a loaded machine sees when a broker answers and closes right after:
both are waiting when it next reads. The proxy forwards client bytes at once, and holds
server bytes until the server has been quiet for `quiet_s` (or closed), then sends them
in one write and, if the server closed, closes its side right behind them.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def _pipe_client_bytes(client: socket.socket, server: socket.socket) -> None:
    try:
        while data := client.recv(65536):
            server.sendall(data)
    except OSError:
        pass
    finally:
        _shut_write(server)


def _pipe_server_bytes(server: socket.socket, client: socket.socket, quiet_s: float) -> None:
    held = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        while True:
            ready = selector.select(timeout=quiet_s if held else None)
            if not ready:  # quiet: the answer is complete
                client.sendall(held)
                held.clear()
                continue
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data:  # closed: the held answer and the close go together
                try:
                    client.sendall(held)
                except OSError:
                    pass
                _shut_write(client)
                return
            held += data


def _shut_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@contextmanager
def coalescing_proxy(target: tuple[str, int], quiet_s: float = 0.1) -> Iterator[str]:
    """Listen on a free local port in front of `target`; yields its `host:port`."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopped = threading.Event()
    opened: list[socket.socket] = []

    def accept() -> None:
        while not stopped.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(target)
            opened.extend((client, server))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pipe_client_bytes, args=(client, server),
                             daemon=True).start()
            threading.Thread(target=_pipe_server_bytes, args=(server, client, quiet_s),
                             daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stopped.set()
        listener.close()
        for sock in opened:
            sock.close()
