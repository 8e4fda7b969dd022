"""The gateway's runtime: state built from a policy, the request pipeline, and the two ASGI apps."""

from __future__ import annotations

from typing import Any

import aiohttp
from starlette.types import ASGIApp

from gateway.config import Policy
from gateway.ingress.asgi import DataPlane
from gateway.pipeline.chain import compose
from gateway.pipeline.pick import pick
from gateway.pipeline.watchdog import Watchdog
from gateway.upstream.registry import Registry
from gateway.upstream.transport import Transport, new_session


class Gateway:
    """Everything one gateway process serves from. Create it inside the running event loop."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.registry = Registry(policy)
        self.session: aiohttp.ClientSession = new_session()
        self.watchdog = Watchdog()
        self.watchdog.start()
        handler = compose([pick], Transport(self.session, self.watchdog))
        self.data_app = DataPlane(
            self.registry,
            handler,
            max_request_bytes=policy.limits.max_request_bytes,
            readiness=self.readiness,
        )
        from gateway.admin import build_admin_app  # the admin plane depends on Gateway

        self.admin_app: ASGIApp = build_admin_app(self)

    async def close(self) -> None:
        await self.watchdog.close()
        await self.session.close()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when the policy is loaded and every pool has an instance that takes traffic."""
        pools = {name: len(pool.instances) > 0 for name, pool in self.registry.pools.items()}
        ready = all(pools.values())
        return ready, {"ready": ready, "pools": pools}

    def state(self) -> dict[str, Any]:
        """The operator's view, served as /admin/state."""
        return {
            "pools": {
                name: {
                    "models": list(pool.policy.models),
                    "instances": [
                        {
                            "name": inst.name,
                            "url": inst.base_url,
                            "state": "ADMITTING",
                            "in_flight": inst.in_flight,
                            "requests": inst.requests,
                        }
                        for inst in pool.instances
                    ],
                }
                for name, pool in self.registry.pools.items()
            },
            "shared_state": {"configured": self.policy.shared is not None, "connected": False},
        }
