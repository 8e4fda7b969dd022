"""TLS to https:// instances: one client SSLContext per pool, built once from its `tls` policy.

The context is passed with every request, and the clients key their connection pools by host,
port and context, so connections are still reused per instance. The handshake is part of a new
connection: it is bounded by the attempt's connect timeout (`timeouts.connect`), and its
failures (an untrusted certificate, a wrong host name) are connect failures. SNI and host
name checks come with the context (`check_hostname`) and the URL's host.
"""

from __future__ import annotations

import logging
import ssl

from gateway.config.models import TlsPolicy

log = logging.getLogger("gateway.tls")

# What aiohttp takes as `ssl=` for its default: verification with the system's CAs.
DEFAULT_SSL: ssl.SSLContext | bool = True


def client_ssl(policy: TlsPolicy | None, pool: str) -> ssl.SSLContext | bool:
    """The `ssl=` argument for a pool's requests (built once per pool and policy)."""
    if policy is None:
        return DEFAULT_SSL
    if not policy.verify:
        log.warning(
            "TLS certificate verification is off for this pool: its traffic can be intercepted",
            extra={"fields": {"pool": pool}},
        )
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if policy.ca_pem is None:
        return ssl.create_default_context()
    return ssl.create_default_context(cadata=policy.ca_pem)
