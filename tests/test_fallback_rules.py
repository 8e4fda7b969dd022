"""What hands a request over, and where to: the policy's fallback graph as `gateway check`
reports it (file:line), the refusals read from engines' error bodies, and the order pools are
tried in."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.config import load_policy
from gateway.config.routes import CHAT
from gateway.core.refusals import refusal_of
from gateway.ingress.fallback import Handover
from gateway.pipeline.call import Call, RequestFacts
from gateway.runtime import Cancellation
from gateway.upstream.pool import PoolState
from tests.test_cli_check import gateway_cli


def _pools(body: str) -> str:
    return "listen: 127.0.0.1:18080\nadmin: {listen: 127.0.0.1:19901}\npools:\n" + body


def _pool(name: str, extra: str = "") -> str:
    return (
        f"  {name}:\n    models: [{name}-model]\n"
        f'    instances: [{{name: {name}1, url: "http://127.0.0.1:9"}}]\n' + extra
    )


def _check(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    done = gateway_cli("check", path)
    assert done.returncode == (1 if done.stderr else 0), done.stderr
    return [line.split(": ", 1)[1] for line in done.stderr.splitlines()]


def test_a_valid_graph_passes(tmp_path: Path) -> None:
    text = _pools(
        _pool("a", "    fallbacks: [b, {pool: c, model: c-model}]\n")
        + _pool("b", "    fallbacks: [c]\n    context_fallbacks: [c]\n")
        + _pool("c")
    )
    assert _check(tmp_path, text) == []


def test_loops_unknown_pools_models_and_self_are_reported_at_their_line(tmp_path: Path) -> None:
    text = _pools(
        _pool("a", "    fallbacks: [b]\n")
        + _pool("b", "    fallbacks:\n      - a\n      - zz\n      - {pool: a, model: nope}\n")
        + _pool("c", "    context_fallbacks: [c]\n")
    )
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    done = gateway_cli("check", path)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    by_key = {line.split(": ")[1]: line for line in lines}
    assert by_key["pools.b.fallbacks[0].pool"].endswith("fallback loop: a -> b -> a")
    assert by_key["pools.b.fallbacks[0].pool"].startswith(f"{path}:12:")
    assert "no pool 'zz' (pools: a, b, c)" in by_key["pools.b.fallbacks[1].pool"]
    assert by_key["pools.b.fallbacks[1].pool"].startswith(f"{path}:13:")
    assert "does not serve 'nope'" in by_key["pools.b.fallbacks[2].model"]
    assert "cannot fall back to itself" in by_key["pools.c.context_fallbacks[0].pool"]


def test_the_depth_is_bounded(tmp_path: Path) -> None:
    names = ["a", "b", "c", "d", "e"]
    text = _pools(
        "".join(
            _pool(name, f"    fallbacks: [{after}]\n" if after else "")
            for name, after in zip(names, [*names[1:], None], strict=True)
        )
    )
    (error,) = _check(tmp_path, text)
    assert "longer than 3 hand-overs: a -> b -> c -> d -> e" in error


def test_client_errors_are_never_retried(tmp_path: Path) -> None:
    for status in (400, 401, 403):
        (error,) = _check(tmp_path, _pools(_pool("a", f"    retries: {{on: [{status}]}}\n")))
        assert f"{status} is never retried" in error


def _error(message: str, kind: str = "BadRequestError", code: object = 400) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


@pytest.mark.parametrize(
    "body",
    [
        # vLLM, older and newer wordings
        _error(
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens (4992 in the messages, 8 in the completion). Please reduce the length of "
            "the messages or completion."
        ),
        _error(
            "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum "
            "context length is 4096 tokens and your request has 200 input tokens (4000 > 4096 "
            "- 200)."
        ),
        _error("The decoder prompt (length 5000) is longer than the maximum model length of 4096."),
        # llama.cpp's server
        json.dumps(
            {
                "error": {
                    "code": 400,
                    "message": "request (4476 tokens) exceeds the available context size "
                    "(4096 tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 4476,
                    "n_ctx": 4096,
                }
            }
        ).encode(),
        _error("the request exceeds the available context size. try increasing the context size"),
        # OpenAI
        _error("...", "invalid_request_error", "context_length_exceeded"),
        # Anthropic
        json.dumps(
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "prompt is too long: 208000 tokens > 200000 maximum",
                },
            }
        ).encode(),
        json.dumps(
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "input length and `max_tokens` exceed context limit: 198000 + "
                    "8192 > 200000, decrease input length or `max_tokens` and try again",
                },
            }
        ).encode(),
    ],
)
def test_context_length_as_engines_word_it(body: bytes) -> None:
    assert refusal_of(400, body) == "context_length"


@pytest.mark.parametrize(
    "body",
    [
        _error("Your request was rejected as a result of our safety system.", code=None),
        _error("flagged", "invalid_request_error", "content_policy_violation"),
        _error(
            "The response was filtered due to the prompt triggering Azure OpenAI's content "
            "management policy.",
            code="content_filter",
        ),
    ],
)
def test_content_policy_refusals(body: bytes) -> None:
    assert refusal_of(400, body) == "content_policy"


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, _error("temperature must be between 0 and 2")),  # a validation error
        (400, b"not json"),
        (400, b'["an", "array"]'),
        (500, _error("This model's maximum context length is 4096 tokens.")),  # not a 4xx
        (400, b""),
    ],
)
def test_anything_else_is_no_refusal(status: int, body: bytes) -> None:
    assert refusal_of(status, body) is None


def _registry(tmp_path: Path, text: str) -> dict[str, PoolState]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    policy = load_policy(path)
    rng = random.Random(1)
    return {name: PoolState(name, pool, rng, 0.0) for name, pool in policy.pools.items()}


def _call(pool: PoolState) -> Call:
    facts = RequestFacts(pool.policy.models[0], False, None, {"model": pool.policy.models[0]})
    cancellation = Cancellation(None)
    return Call(pool, CHAT, "", b"{}", [], facts, 1e9, cancellation)


def test_pools_are_tried_depth_first_once_each_and_within_the_depth(tmp_path: Path) -> None:
    pools = _registry(
        tmp_path,
        _pools(
            _pool("a", "    fallbacks: [b, c]\n    context_fallbacks: [big]\n")
            + _pool("b", "    fallbacks: [d, c]\n")
            + _pool("c", "    fallbacks: [e]\n    fallback_on: [shed]\n")
            + _pool("d")
            + _pool("e")
            + _pool("big")
        ),
    )
    handover = Handover(_call(pools["a"]))
    order = []
    pool = pools["a"]
    for cause in ("unavailable", "server_error", "unavailable"):
        target = handover.next(pool, cause)
        assert target is not None
        handover.went_to(pool.name, target.pool, cause)
        order.append(target.pool)
        pool = pools[target.pool]
    # a -> b (a's first), b -> d (b's own first), d has none: c (b's next, once, not a's again)
    assert order == ["b", "d", "c"]
    # c failed for a cause its fallback_on does not name: its list is not used, and the
    # depth (3 hand-overs) is reached anyway.
    assert handover.next(pool, "server_error") is None
    assert handover.reasons == ["a>b:unavailable", "b>d:server_error", "d>c:unavailable"]


def test_context_length_uses_context_fallbacks_only(tmp_path: Path) -> None:
    pools = _registry(
        tmp_path,
        _pools(
            _pool("a", "    fallbacks: [b]\n    context_fallbacks: [big]\n")
            + _pool("b")
            + _pool("big")
        ),
    )
    handover = Handover(_call(pools["a"]))
    target = handover.next(pools["a"], "context_length")
    assert target is not None and target.pool == "big"
    handover.went_to("a", "big", "context_length")
    assert handover.next(pools["big"], "context_length") is None  # never b
    pools_without = _registry(tmp_path, _pools(_pool("a", "    fallbacks: [b]\n") + _pool("b")))
    alone = Handover(_call(pools_without["a"]))
    assert alone.next(pools_without["a"], "context_length") is None
