"""gateway.ingress.accept: every pending connection is taken at one wakeup."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.ingress.accept import ACCEPT_BATCH, BatchAcceptor
from gateway.server import bind_listener


class Counting(asyncio.Protocol):
    made: list[Counting] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        Counting.made.append(self)


class ScriptedListener:
    """A listening socket whose first `accept` calls raise the errors given."""

    def __init__(self, sock: socket.socket, errors: list[int]) -> None:
        self.sock = sock
        self.family = sock.family
        self.errors = errors
        self.calls = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, f"scripted {errno.errorcode[code]}")
        return self.sock.accept()


@contextmanager
def clients(port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections, handshakes done by the kernel: all waiting to be accepted."""
    made = []
    try:
        for _ in range(count):
            made.append(socket.create_connection(("127.0.0.1", port)))
        yield made
    finally:
        for sock in made:
            sock.close()


def pending(sock: socket.socket) -> bool:
    """Whether a connection still waits in the kernel's accept queue (it is taken if so)."""
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.fixture(autouse=True)
def fresh_count() -> None:
    Counting.made = []


async def settle(acceptor: BatchAcceptor) -> None:
    acceptor.close()
    await acceptor.wait_closed()


async def test_one_wakeup_takes_every_pending_connection() -> None:
    loop = asyncio.get_running_loop()
    with bind_listener("127.0.0.1", 0) as sock, clients(sock.getsockname()[1], 40) as made:
        listener = ScriptedListener(sock, [])
        acceptor = BatchAcceptor(loop, listener, Counting)  # type: ignore[arg-type]
        acceptor._accept()  # the one wakeup, before the loop runs its reader
        assert listener.calls == 41  # forty connections, then the empty queue
        assert not pending(sock)
        await settle(acceptor)
        assert len(Counting.made) == len(made) == 40
        for protocol in Counting.made:
            conn = protocol.transport.get_extra_info("socket")
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            protocol.transport.close()


async def test_one_wakeup_takes_at_most_a_batch() -> None:
    loop = asyncio.get_running_loop()
    with (
        bind_listener("127.0.0.1", 0) as sock,
        clients(sock.getsockname()[1], ACCEPT_BATCH + 1),
    ):
        listener = ScriptedListener(sock, [])
        acceptor = BatchAcceptor(loop, listener, Counting)  # type: ignore[arg-type]
        acceptor._accept()
        assert listener.calls == ACCEPT_BATCH
        assert pending(sock)  # the last one, for the next wakeup
        await settle(acceptor)
        assert len(Counting.made) == ACCEPT_BATCH
        for protocol in Counting.made:
            protocol.transport.close()


async def test_a_client_gone_before_its_accept_does_not_hold_the_others_back() -> None:
    loop = asyncio.get_running_loop()
    with bind_listener("127.0.0.1", 0) as sock, clients(sock.getsockname()[1], 2):
        listener = ScriptedListener(sock, [errno.ECONNABORTED])
        acceptor = BatchAcceptor(loop, listener, Counting)  # type: ignore[arg-type]
        acceptor._accept()
        assert not pending(sock)
        await settle(acceptor)
        assert len(Counting.made) == 2
        for protocol in Counting.made:
            protocol.transport.close()


async def test_out_of_file_descriptors_pauses_accepting_then_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    with bind_listener("127.0.0.1", 0) as sock, clients(sock.getsockname()[1], 3):
        listener = ScriptedListener(sock, [errno.EMFILE])
        with caplog.at_level(logging.ERROR, logger="gateway"):
            acceptor = BatchAcceptor(
                loop,
                listener,  # type: ignore[arg-type]
                Counting,
                retry_after_s=0.05,
            )
            acceptor._accept()
        assert listener.calls == 1  # no spinning on the error
        assert [r.getMessage() for r in caplog.records] == ["cannot accept connections, retrying"]
        for _ in range(500):  # the retry, then the loop's own wakeup
            if len(Counting.made) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(Counting.made) == 3
        await settle(acceptor)
        for protocol in Counting.made:
            protocol.transport.close()


async def test_a_closed_acceptor_takes_no_new_connection() -> None:
    loop = asyncio.get_running_loop()
    with bind_listener("127.0.0.1", 0) as sock:
        acceptor = BatchAcceptor(loop, sock, Counting)
        await settle(acceptor)
        assert acceptor.closed
        with clients(sock.getsockname()[1], 1):
            await asyncio.sleep(0.05)  # a wakeup the reader would have had
            assert Counting.made == []
            assert pending(sock)
