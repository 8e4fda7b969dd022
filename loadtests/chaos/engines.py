"""Real engines as chaos instances: llama.cpp's server (loadtests/engine) on a generated model.

An instance's engine keeps one port for the whole run, so a killed engine starts again where
clients and the gateway expect it. Each start logs to its own file in the run directory
(`<instance>-<n>.llama-server.log`), kept for a post-mortem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loadtests.chaos.scenario import EngineBackendSpec
from loadtests.engine.model import model_path
from loadtests.engine.server import Engine, start_engine

# A slow engine loads its 1.2 GB model from the page cache in a second or two; the margin is for
# a cold cache on a busy machine.
READY_TIMEOUT_S = 120.0


@dataclass
class EngineLauncher:
    """How to start (and start again) one instance's engine."""

    name: str
    spec: EngineBackendSpec
    port: int
    alias: str  # the model name the engine reports (it serves whatever name a request gives)
    log_dir: Path
    starts: int = 0

    def start(self) -> Engine:
        """Start the engine on its port; returns once it answers /health."""
        self.starts += 1
        return start_engine(
            model_path(self.spec.preset),  # written once per machine, then cached
            port=self.port,
            slots=self.spec.slots,
            alias=self.alias,
            log_path=self.log_dir / f"{self.name}-{self.starts}.llama-server.log",
            ready_timeout_s=READY_TIMEOUT_S,
            niceness=self.spec.nice.get(self.name, 0),
            # threads: engine_argv's one thread per engine, so that engines on a small machine
            # do not fight over cores and runs stay comparable.
        )
