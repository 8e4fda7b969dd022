"""Policy files: models, units, loading with line-numbered errors."""

from gateway.config.loader import PolicyError, Problem, load_policy, parse_policy
from gateway.config.models import (
    InstancePolicy,
    Policy,
    PoolPolicy,
    TimeoutsPolicy,
    split_host_port,
)

__all__ = [
    "InstancePolicy",
    "Policy",
    "PolicyError",
    "PoolPolicy",
    "Problem",
    "TimeoutsPolicy",
    "load_policy",
    "parse_policy",
    "split_host_port",
]
