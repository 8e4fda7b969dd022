"""The writer a stream's pieces take from the upstream's callback (gateway/ingress/writer.py)."""

from __future__ import annotations

import asyncio

from gateway.ingress.writer import CLIENT_TRANSPORT, ChunkedWriter, client_writer


class Transport(asyncio.Transport):
    """What the writer reads of a transport: writes, its buffer, whether it is closing."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


async def test_the_pieces_of_one_loop_turn_go_out_in_one_chunk_at_its_end() -> None:
    transport = Transport()
    writer = ChunkedWriter(transport, asyncio.get_running_loop())
    writer.write(b"data: 1\n\n")
    writer.write(b"data: 2\n\n")
    assert transport.writes == []  # not before the turn's end
    await asyncio.sleep(0)
    assert transport.writes == [b"12\r\ndata: 1\n\ndata: 2\n\n\r\n"]
    writer.write(b"data: 3\n\n")
    writer.flush()  # before anything else is sent: at once
    assert transport.writes[-1] == b"9\r\ndata: 3\n\n\r\n"
    await asyncio.sleep(0)  # the turn's own flush finds nothing left
    assert len(transport.writes) == 2


async def test_it_takes_pieces_only_while_the_client_takes_them_at_once() -> None:
    transport = Transport()
    writer = ChunkedWriter(transport, asyncio.get_running_loop())
    assert writer.writable()
    transport.buffered = 10  # a client slow to read: uvicorn's send waits for it instead
    assert not writer.writable()
    transport.buffered = 0
    writer.write(b"data: 1\n\n")
    transport.closing = True  # the client left: what was pending goes nowhere
    assert not writer.writable()
    await asyncio.sleep(0)
    assert transport.writes == []


async def test_a_writer_needs_the_transport_in_the_scope_and_a_body() -> None:
    writer = ChunkedWriter(Transport(), asyncio.get_running_loop())
    extensions = {CLIENT_TRANSPORT: {"writer": writer}}
    assert client_writer({"method": "POST", "extensions": extensions}) is not None
    assert client_writer({"method": "HEAD", "extensions": extensions}) is None
    assert client_writer({"method": "POST"}) is None
    assert client_writer({"method": "POST", "extensions": {"other": {}}}) is None
