"""`GET /metrics` of `gpt-fast serve` on the tiny random model (a server in a subprocess of its own, so that its
counts start at zero): parsed with prometheus_client's own parsers, the counts equal what the answers' usage and
finish reasons report; the key is required; each server's metrics live in a registry of their own."""

from __future__ import annotations

import collections
import urllib.error
import urllib.request

import prometheus_client
import pytest
import torch
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from gpt_fast import Engine
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.options import BatchOptions
from gpt_fast.model.shapes import get_shape
from gpt_fast.serve.metrics import FINISH_REASONS, ServerMetrics
from tests.test_serve import KEY, Server, streamed
from tests.tiny import one_torch_thread

SLOTS, CONTEXT = 2, 128
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    weights = make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)
    return weights.parent


@pytest.fixture(scope="module")
def server(tiny_dir):
    args = ("--max_batch", str(SLOTS), "--max_seq_length", str(CONTEXT), "--api_key", KEY, "--model_name", "tiny")
    server = Server("--checkpoint_path", str(tiny_dir), *args)
    yield server
    server.stop()


def scrape(server: Server, headers: dict[str, str]) -> tuple[int, str, str]:
    """``GET /metrics``: the status, the content type and the body."""
    request = urllib.request.Request(f"{server.url}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def samples(text: str, parse=text_string_to_metric_families) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, by its name and labels (``le`` and ``reason``, as they are written)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parse(text)
        for sample in family.samples
    }


def value(found: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return found[(f"gpt_fast_{name}", tuple(sorted(labels.items())))]


def test_the_counters_equal_the_answers_usage(server):
    client = server.client(api_key=KEY)
    answers = [client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0)]
    text = answers[0].choices[0].text
    assert text
    answers.append(
        client.completions.create(
            model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0, stop=[text[-2:]]
        )
    )
    answers.append(client.completions.create(model="tiny", prompt=["Once upon", "1, 2, 3,"], max_tokens=5))
    reasons = collections.Counter(c.finish_reason for answer in answers for c in answer.choices)
    usages = [answer.usage for answer in answers]
    for prompt in ("Hello, my name is", "def f(x):"):
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=7, stream=True, stream_options={"include_usage": True}
        )
        _, finished, usage = streamed(stream)
        reasons.update(finished)
        usages.append(usage)
    assert reasons["stop"] >= 1 and reasons["length"] >= 1
    requests = sum(reasons.values())

    status, content_type, body = scrape(server, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and content_type == "text/plain; version=0.0.4; charset=utf-8"
    found = samples(body)
    assert value(found, "prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value(found, "generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for reason in FINISH_REASONS:
        assert value(found, "requests_finished_total", reason=reason) == reasons[reason]
    assert value(found, "requests_failed_total") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert value(found, f"{name}_count") == value(found, f"{name}_bucket", le="+Inf") == requests
        buckets = sorted(
            (float(dict(labels)["le"]), n) for (key, labels), n in found.items() if key.endswith(f"{name}_bucket")
        )
        assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
    # A request's tokens after its first are each one gap after the token before.
    gaps = sum(u.completion_tokens for u in usages) - requests
    assert value(found, "inter_token_latency_seconds_count") == gaps
    assert value(found, "e2e_request_latency_seconds_sum") >= value(found, "time_to_first_token_seconds_sum") > 0

    assert value(found, "requests_running") == value(found, "requests_waiting") == 0
    blocks, used = value(found, "kv_cache_blocks"), value(found, "kv_cache_blocks_used")
    assert blocks == SLOTS * CONTEXT // 16 and value(found, "kv_cache_block_size_tokens") == 16  # the default size
    assert used == 0 and value(found, "kv_cache_usage_ratio") == 0  # idle: every request gave its blocks back
    queried, hit = value(found, "prefix_cache_queried_tokens_total"), value(found, "prefix_cache_hit_tokens_total")
    assert (
        queried == value(found, "prompt_tokens_total")
        and 0 <= hit <= queried
        and value(found, "prefix_cache_hit_ratio") == (hit / queried if queried else 0)
    )
    assert ("gpt_fast_preemptions_total", ()) in found


def test_the_key_is_required_and_openmetrics_is_negotiated(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, content_type, _ = scrape(server, headers)
        assert status == 401 and content_type == "application/json"
    status, content_type, body = scrape(server, {"Authorization": f"Bearer {KEY}", "Accept": OPENMETRICS})
    assert status == 200 and content_type.startswith("application/openmetrics-text; version=1.0.0")
    found = samples(body, parse_openmetrics)
    assert value(found, "requests_running") == 0 and ("gpt_fast_requests_failed_total", ()) in found


def test_each_server_has_a_registry_of_its_own(tiny_dir):
    with one_torch_thread():
        batcher = Engine.load(tiny_dir, device="cpu").batcher(BatchOptions(max_batch=1, max_seq_length=32))
    first, second = ServerMetrics(batcher), ServerMetrics(batcher)
    first.prompt_tokens.inc(3)
    assert value(samples(first.exposition("")[0].decode()), "prompt_tokens_total") == 3
    assert value(samples(second.exposition("")[0].decode()), "prompt_tokens_total") == 0
    assert not [m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("gpt_fast_")]
