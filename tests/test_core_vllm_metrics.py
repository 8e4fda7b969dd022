from __future__ import annotations

import pytest

from gateway.core.vllm_metrics import read_running, read_vllm_load

PAGE = b"""# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen {3} 8b"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen {3} 8b"} 2.0
# a longer name that starts with the one we read must not count
vllm:num_requests_waiting_by_reason{reason="capacity"} 100.0
vllm:num_requests_running{model_name="m"} 7.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
"""


def test_waiting_adds_up_and_cache_usage_is_the_fullest_engine() -> None:
    assert read_vllm_load(PAGE) == (5.0, 0.75)


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (b"vllm:num_requests_waiting 4\n", (4.0, None)),  # first line, no labels, no newline after
        (b'vllm:kv_cache_usage_perc{model_name="m"} 0.9', (None, 0.9)),  # vLLM >= 0.10 name
        (b"vllm:num_requests_waiting NaN\nvllm:num_requests_waiting 1\n", (1.0, None)),
        (b'vllm:num_requests_waiting{a="b"} garbage\n', (None, None)),
        (b"vllm:num_requests_waiting 2 1712345678000\n", (2.0, None)),  # with a timestamp
        (b"", (None, None)),
        (b"<html>not a metrics page</html>", (None, None)),
    ],
)
def test_edge_cases(page: bytes, expected: tuple[float | None, float | None]) -> None:
    assert read_vllm_load(page) == expected


def test_llama_cpp_names_its_queue_and_running_requests_its_own_way() -> None:
    page = (
        b"# HELP llamacpp:requests_processing Number of requests processing.\n"
        b"# TYPE llamacpp:requests_processing gauge\n"
        b"llamacpp:requests_processing 4\n"
        b"llamacpp:requests_deferred 2\n"
    )
    assert read_vllm_load(page) == (2.0, None)
    assert read_running(page) == 4.0


def test_running_requests_add_up_over_vllm_engines() -> None:
    page = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
    )
    assert read_running(page) == 8.0
    assert read_running(b"other 1\n") is None
