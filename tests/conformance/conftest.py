"""Fixtures of the conformance scenarios: each on both event loops, a fresh client per test, and
a loopback TLS pair."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Mapping

import pytest
import trustme
import uvloop

from gateway.upstream.h1 import H1Client


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The gateway serves on uvloop and its tests run on asyncio's loop: the client's
    transport behaviour (TLS ends, pausing, resets) must hold on both."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
async def client() -> AsyncIterator[H1Client]:
    """The data plane's client with the transport's idle limit; its connections closed after."""
    h1 = H1Client(keepalive_s=4.0)
    try:
        yield h1
    finally:
        h1.close()


@pytest.fixture(scope="session")
def tls_pair() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for 127.0.0.1, and a client context trusting it."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    return server, trusting
