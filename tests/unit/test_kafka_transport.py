"""How kafka-python's transports read their socket (ingest/io/kafka_transport.py), on real
socket pairs."""

from __future__ import annotations

import socket
import struct

import pytest
from kafka.errors import KafkaConnectionError
from kafka.net import transport

from ingest.io.kafka_transport import chunked_reader

read = chunked_reader((BlockingIOError, InterruptedError))


class CountingSocket:
    """A real socket that counts the `recv` calls made on it."""

    def __init__(self, sock: socket.socket):
        self.sock, self.calls = sock, 0

    def recv(self, size: int) -> bytes:
        self.calls += 1
        return self.sock.recv(size)


class Transport:
    def __init__(self, sock: socket.socket):
        self._sock = CountingSocket(sock)


@pytest.fixture
def pair():
    """A broker-side and a client-side TCP socket, connected over loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        broker, _ = server.accept()
    # Room for a whole response in the socket, as a fetch response of megabytes has.
    for sock in (broker, client):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 2**20)
    client.setblocking(False)
    yield broker, Transport(client)
    broker.close()
    client.close()


def test_a_response_of_megabytes_is_read_in_large_chunks(pair):
    broker, transport_ = pair
    response = bytes(range(256)) * (4 * 2**20 // 256)
    broker.sendall(response)
    received = b""
    while len(received) < len(response):
        data, error = read(transport_)
        assert error is None
        received += data
    assert received == response
    # 4 KiB reads (kafka-python's own) take 1,024 calls and more; 64 KiB ones, 64.
    assert transport_._sock.calls <= 64


def test_nothing_to_read_is_no_bytes_and_no_error(pair):
    _, transport_ = pair
    assert read(transport_) == (b"", None)


def test_bytes_read_together_with_the_close_come_first_and_the_close_next(pair):
    """A refused SASL login: the broker's answer and its close, read in one pass."""
    broker, transport_ = pair
    answer = struct.pack(">i", 6) + b"refused"[:6]
    broker.sendall(answer)
    broker.close()
    assert read(transport_) == (answer, None)
    data, error = read(transport_)
    assert data == b""
    assert isinstance(error, KafkaConnectionError)
    assert "socket disconnected" in str(error)


def test_a_reset_connection_is_a_connection_error(pair):
    broker, transport_ = pair
    broker.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    broker.close()  # linger 0: a reset, not an orderly close
    data, error = read(transport_)
    assert data == b""
    assert isinstance(error, KafkaConnectionError)
    assert "Connection reset" in str(error)


def test_every_kafka_client_transport_reads_in_chunks():
    import ingest.io.kafka  # noqa: F401  (installs the readers, as every client's module)

    for cls in (transport.KafkaTCPTransport, transport.KafkaSSLTransport):
        assert cls._sock_recv.__module__ == "ingest.io.kafka_transport", cls
