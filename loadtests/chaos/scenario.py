"""Chaos scenarios: the backends, the workload, and a timeline of faults, read from YAML.

A fault happens at a time (`at: 30s`, or `at: 25%` of the planned run, so a scenario scales with
the request count) or at a request number (`at_request: 5000`), and may revert by itself after
`for:`. The same scenario and seed give the same sequence of faults and requests.

A scenario's instances are fake vLLM servers by default (`backend:` sets their time
compression), or real engines with `backend: {engine: llama.cpp, preset: slow, slots: 4}`:
llama.cpp's server on a generated model (loadtests/engine). A real engine has no fault knobs, so
its instances take the process actions and `network`, never `set` or `clear`.

The reserved target `redis` is the Redis through which the gateway shares isolation decisions
(started with the backends when a step targets it or the scenario says `shared: true`); it takes
the process actions (kill, stop, start, restart, freeze, thaw) and `pause`, which no instance
takes. A Redis fault must cost the gateway nothing: Redis is never on the request path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from gateway.config.units import Duration, parse_duration

Action = Literal[
    "set",  # merge fault knobs into a fake backend (`set: {error_rate: 0.3}`)
    "clear",  # every fault knob of a fake backend back to its default
    "kill",  # SIGKILL
    "stop",  # SIGTERM: the port then refuses connections
    "start",  # start a stopped or killed instance again, on the same port
    "restart",  # stop, then start
    "freeze",  # SIGSTOP: connections hang, nothing answers
    "thaw",  # SIGCONT
    "network",  # fault knobs of the TCP proxy in front of the instance (`network: {latency: 0.05}`)
    "pause",  # redis only: CLIENT PAUSE ... ALL for the step's `for:` (commands held, then served)
]

REDIS = "redis"  # the reserved target: the Redis of shared decisions, not a backend instance
# What `redis` takes: it is a process (no fault knobs, no proxy in front), and `pause` is its own.
REDIS_ACTIONS = ("kill", "stop", "start", "restart", "freeze", "thaw", "pause")


# Actions that `for:` can undo: set/network revert their knobs, freeze thaws, stop/kill restart;
# a pause lasts its `for:` (Redis itself ends it).
REVERTIBLE = ("set", "freeze", "network", "stop", "kill", "pause")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class When(_Strict):
    """A point of the run: seconds, a share of the planned run, or a request number."""

    seconds: float | None = None
    fraction: float | None = None
    request: int | None = None

    def resolve(self, planned_s: float) -> float | None:
        """Seconds from the start, or None for a request-number trigger."""
        if self.seconds is not None:
            return self.seconds
        if self.fraction is not None:
            return self.fraction * planned_s
        return None


def parse_when(value: object) -> When:
    if isinstance(value, str) and value.strip().endswith("%"):
        return When(fraction=float(value.strip()[:-1]) / 100.0)
    return When(seconds=parse_duration(value))


class FaultStep(_Strict):
    at: str | float | None = None
    at_request: Annotated[int, Field(ge=0)] | None = None
    target: str
    action: Action
    set: dict[str, Any] = Field(default_factory=dict)
    network: dict[str, Any] = Field(default_factory=dict)
    for_: str | float | None = Field(default=None, alias="for")
    note: str = ""

    @model_validator(mode="after")
    def _valid_step(self) -> FaultStep:
        if (self.at is None) == (self.at_request is None):
            raise ValueError("give exactly one of `at` or `at_request`")
        if self.action == "set" and not self.set:
            raise ValueError("action `set` needs a `set:` mapping of fault knobs")
        if self.action == "network" and not self.network:
            raise ValueError("action `network` needs a `network:` mapping")
        if self.for_ is not None and self.action not in REVERTIBLE:
            raise ValueError(f"`for` cannot revert action {self.action!r}")
        if self.target == REDIS and self.action not in REDIS_ACTIONS:
            raise ValueError(
                f"action {self.action!r} does not apply to target `redis` (a process with no "
                f"fault knobs and no proxy): use one of {', '.join(REDIS_ACTIONS)}"
            )
        if self.action == "pause":
            if self.target != REDIS:
                raise ValueError(
                    f"action `pause` is for target `redis` only, not {self.target!r} "
                    "(freeze an instance instead)"
                )
            if self.for_ is None:
                raise ValueError("action `pause` needs `for:` (how long Redis holds commands)")
            length = parse_when(self.for_)
            if (length.seconds or length.fraction or 0.0) <= 0.0:
                raise ValueError("action `pause` needs a positive `for:`")
        return self

    def when(self) -> When:
        if self.at_request is not None:
            return When(request=self.at_request)
        return parse_when(self.at)

    def duration(self) -> When | None:
        return None if self.for_ is None else parse_when(self.for_)


class BackendSpec(_Strict):
    """The fake vLLM instances, and the time compression of the run."""

    ttft: Duration = 0.05
    per_token: Duration = 0.001
    tokens_per_event: Annotated[int, Field(ge=1)] = 32


# Steps that need the fake backend's fault knobs (its /_fake/ control endpoints).
KNOB_ACTIONS = ("set", "clear")


class EngineBackendSpec(_Strict):
    """Real engines: one llama.cpp server per instance, on a generated model (loadtests/engine),
    at its real speed: nothing is compressed, one thread per engine."""

    engine: Literal["llama.cpp"]
    preset: str = "slow"  # a model of loadtests.engine.model.PRESETS
    slots: Annotated[int, Field(ge=1, le=64)] = 4  # --parallel: sequences decoded together
    # Instances whose engine runs at a lower CPU priority (niceness 1-19): on a machine whose
    # cores the engines share, one slower than its peers, as on a host with busier neighbours.
    nice: dict[str, Annotated[int, Field(ge=1, le=19)]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_fake_knobs(cls, data: Any) -> Any:
        # Said plainly here: "extra inputs are not permitted" would not tell why.
        fake = sorted(set(data) & set(BackendSpec.model_fields)) if isinstance(data, dict) else []
        if fake:
            raise ValueError(
                f"{', '.join(fake)}: knob(s) of the fake backend; an engine backend runs at its "
                "real speed and takes only `preset`, `slots` and `nice`"
            )
        return data

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        # Imported here: the model module pulls in numpy and gguf, which a fake run never needs.
        from loadtests.engine.model import PRESETS

        if value not in PRESETS:
            raise ValueError(f"unknown engine preset {value!r}: one of {', '.join(PRESETS)}")
        return value


def _backend_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "engine" if "engine" in value else "fake"
    return "engine" if isinstance(value, EngineBackendSpec) else "fake"


Backend = Annotated[
    Annotated[BackendSpec, Tag("fake")] | Annotated[EngineBackendSpec, Tag("engine")],
    Discriminator(_backend_kind),
]


Protocol = Literal["openai", "anthropic"]


class PoolSpec(_Strict):
    models: list[str] = Field(min_length=1)
    instances: Annotated[int, Field(ge=1, le=32)] = 3
    # How clients call the pool's models: OpenAI's chat/completions routes, or Anthropic's
    # Messages API (`POST /v1/messages`), in both modes; the fake backends speak both.
    protocol: Protocol = "openai"


class ScenarioWorkload(_Strict):
    chat_share: Annotated[float, Field(ge=0, le=1)] = 0.7
    stream_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    prompt_tokens: tuple[int, int] = (512, 4096)
    max_tokens: tuple[int, int] = (512, 4096)
    arrival: Literal["poisson", "fixed"] = "poisson"
    concurrency_cap: Annotated[int, Field(ge=0)] = 0
    # A share of requests whose prompt is `long_prompt_tokens` long instead of `prompt_tokens`
    # (drawn apart: 0 leaves the request sequence exactly as without it).
    long_prompt_share: Annotated[float, Field(ge=0, le=1)] = 0.0
    long_prompt_tokens: Annotated[int, Field(ge=1)] = 1500
    client_timeout: Duration = 30.0  # what a client without the gateway would wait at most


class Scenario(_Strict):
    name: str
    description: str = ""
    seed: int = 1
    rate: Annotated[float, Field(gt=0)] = 200.0
    requests: Annotated[int, Field(gt=0)] = 2000
    time_limit: Duration | None = None
    backend: Backend = BackendSpec()
    pools: dict[str, PoolSpec] = Field(min_length=1)
    workload: ScenarioWorkload = ScenarioWorkload()
    gateway: dict[str, Any] = Field(default_factory=dict)  # merged into every pool's policy
    faults: list[FaultStep] = Field(default_factory=list)
    # Share the gateway's isolation decisions through a Redis started for the run (implied by
    # any fault step on target `redis`).
    shared: bool = False

    @model_validator(mode="after")
    def _targets_exist(self) -> Scenario:
        names = set(self.instance_names()) | {REDIS}
        for step in self.faults:
            if step.target not in names:
                raise ValueError(f"fault target {step.target!r} is not an instance of the scenario")
        if self.engine is not None:
            for name in self.engine.nice:
                if name not in names:
                    raise ValueError(f"`nice` names {name!r}, not an instance of the scenario")
            for step in self.faults:
                if step.action in KNOB_ACTIONS or (step.target != REDIS and step.set):
                    raise ValueError(
                        f"fault step `{step.action}` on {step.target!r}: an engine backend "
                        f"({self.engine.engine}) has no fault knobs, so `set`/`clear` do not "
                        "apply; use the process actions (kill, stop, start, restart, freeze, "
                        "thaw) or `network`"
                    )
        return self

    @property
    def engine(self) -> EngineBackendSpec | None:
        """The real-engine backend, or None for fake vLLM instances."""
        return self.backend if isinstance(self.backend, EngineBackendSpec) else None

    def instance_names(self) -> list[str]:
        return [f"{pool}-{i}" for pool, spec in self.pools.items() for i in range(spec.instances)]

    def uses_redis(self) -> bool:
        """Whether the run needs a Redis: `shared: true`, or a fault step on it."""
        return self.shared or any(step.target == REDIS for step in self.faults)

    def models(self) -> list[str]:
        return [model for spec in self.pools.values() for model in spec.models]

    def anthropic_models(self) -> tuple[str, ...]:
        """The models of `protocol: anthropic` pools, sent with the Messages API."""
        return tuple(
            model
            for spec in self.pools.values()
            if spec.protocol == "anthropic"
            for model in spec.models
        )

    def planned_s(self, requests: int, rate: float) -> float:
        return requests / rate

    def with_load(self, requests: int | None, rate: float | None) -> Scenario:
        update: dict[str, Any] = {}
        if requests is not None:
            update["requests"] = requests
        if rate is not None:
            update["rate"] = rate
        return self.model_copy(update=update)


SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name (`chaos-mix`) or a YAML file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml")))
        raise SystemExit(f"no scenario {name_or_path!r}; shipped: {shipped}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return Scenario.model_validate(data)
