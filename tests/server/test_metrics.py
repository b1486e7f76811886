"""GET /metrics after a few requests (whole, streamed, n > 1): the token counters grow by exactly what the
responses' usage reported, each finished sample is one TTFT and one end-to-end observation, and the gauges read an
idle engine with an empty KV cache; the serving process's own CPU and memory are there too."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, Served


def scrape(served: Served) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: one model, reasons summed)."""
    with urllib.request.urlopen(served.url + "/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def test_metrics_count_what_usage_reported(served: Served) -> None:
    served.wait_idle()
    before = scrape(served)
    client = served.client()
    kw = dict(model=MODEL, prompt="The list", temperature=0.7, seed=1, extra_body={"ignore_eos": True})
    prompt = completion = samples = 0
    whole = client.completions.create(max_tokens=9, n=2, **kw)
    prompt, completion, samples = whole.usage.prompt_tokens, whole.usage.completion_tokens, 2
    chunks = list(client.completions.create(max_tokens=5, stream=True, stream_options={"include_usage": True}, **kw))
    prompt += chunks[-1].usage.prompt_tokens
    completion += chunks[-1].usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    prompt += chat.usage.prompt_tokens
    completion += chat.usage.completion_tokens
    samples += 2
    served.wait_idle()
    after = scrape(served)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert completion == 9 * 2 + 5 + 3
    assert grew("compile_attn_prompt_tokens_total") == prompt
    assert grew("compile_attn_generation_tokens_total") == completion
    assert grew("compile_attn_request_success_total") == samples
    assert grew("compile_attn_time_to_first_token_seconds_count") == samples
    assert grew("compile_attn_e2e_request_latency_seconds_count") == samples
    assert grew("compile_attn_inter_token_latency_seconds_count") == completion - samples  # one gap per later token
    assert after["compile_attn_num_requests_running"] == after["compile_attn_num_requests_waiting"] == 0
    assert after["compile_attn_kv_cache_usage_perc"] == 0.0
    assert after["compile_attn_kv_cache_capacity_tokens"] >= served.fresh_kv_tokens
    # the process serving HTTP (Linux /proc): it has spent CPU (counted in 10 ms ticks) and holds memory
    assert grew("process_cpu_seconds_total") >= 0 and after["process_cpu_seconds_total"] > 0
    assert after["process_resident_memory_bytes"] > 0
