from __future__ import annotations

import pytest

from gateway.core.vllm_metrics import EngineLoad, read_engine_load, read_kv_tokens

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
    assert read_engine_load(PAGE) == EngineLoad(5.0, 7.0, 0.75, None)


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
    load = read_engine_load(page)
    assert (load.waiting, load.cache_usage) == expected


def test_a_page_without_gauges_is_empty() -> None:
    assert read_engine_load(b"process_cpu_seconds_total 3.5\n").empty
    assert not read_engine_load(b"vllm:num_requests_running 0\n").empty


def test_llama_cpp_names_its_queue_and_running_requests_its_own_way() -> None:
    page = (
        b"# HELP llamacpp:requests_processing Number of requests processing.\n"
        b"# TYPE llamacpp:requests_processing gauge\n"
        b"llamacpp:requests_processing 4\n"
        b"llamacpp:requests_deferred 2\n"
    )
    assert read_engine_load(page) == EngineLoad(2.0, 4.0, None, None)


def test_running_requests_add_up_over_vllm_engines() -> None:
    page = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
    )
    assert read_engine_load(page).running == 8.0
    assert read_engine_load(b"other 1\n").running is None


def test_the_kv_cache_size_is_blocks_times_block_size_over_engines() -> None:
    one = (
        b'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_cpu_blocks="1024",'
        b'num_gpu_blocks="573",num_gpu_blocks_override="None",sliding_window="None"} 1.0\n'
    )
    assert read_kv_tokens(one) == 573 * 16
    assert read_kv_tokens(b"# TYPE vllm:cache_config_info gauge\n" + one) == 573 * 16
    two = (
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1\n'
        b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1\n'
    )
    assert read_kv_tokens(b"vllm:num_requests_running 1\n" + two) == 150 * 16
    # Not sized yet, a label missing, another metric with a longer name: no size.
    unsized = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1'
    assert read_kv_tokens(unsized) is None
    assert read_kv_tokens(b'vllm:cache_config_info{num_gpu_blocks="10"} 1\n') is None
    assert read_kv_tokens(b'vllm:cache_config_info_x{block_size="1",num_gpu_blocks="2"} 1') is None


def test_sglang_and_tgi_queues_are_read_under_their_names() -> None:
    sglang = (
        b'sglang:num_running_reqs{model_name="q"} 8\n'
        b'sglang:num_queue_reqs{model_name="q"} 4\n'
        b'sglang:token_usage{model_name="q"} 0.52\n'
    )
    assert read_engine_load(sglang) == EngineLoad(4.0, 8.0, 0.52, None)
    tgi = b"# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 4\ntgi_queue_size 7\n"
    assert read_engine_load(tgi) == EngineLoad(7.0, 4.0, None, None)
