"""`gpt-fast serve` end to end, through the official ``openai`` client, against servers started on free localhost
ports (each `gpt-fast serve` in a subprocess): chat and completions, streamed or not, on the tiny random model and
on the default model; greedy answers equal to `gpt-fast generate --temperature 0`'s; stop strings and tokens,
max_tokens, seeds, usage, log-probabilities; every error; many clients at once; a client that goes away; and the chat
page in a headless Chromium."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from gpt_fast import Engine, SamplingConfig
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.batcher import CacheUsage
from gpt_fast.model.config import load_checkpoint_config
from gpt_fast.model.shapes import get_shape
from gpt_fast.serve.server import signals_call
from gpt_fast.text.textstream import TextStream
from tests.tiny import one_torch_thread

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key"
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SMOL = "SmolLM2-135M-Instruct"  # the default model's id, as the README calls it
ARTIFACTS = Path(os.environ.get("GPT_FAST_TEST_ARTIFACTS", REPO / "test-artifacts"))


class Server:
    """`gpt-fast serve ARGS --port 0` in a subprocess, until stopped; its output is drained by a thread."""

    def __init__(self, *args: str) -> None:
        # One thread for the server's torch: the tests' clients and the server share the machine's cores.
        env = os.environ | {
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1",
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpt_fast", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()
        self.url = self._wait_until_serving()

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def _wait_until_serving(self) -> str:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if line.startswith("Serving "):
                return line.split(" at ", 1)[1].split("/ ", 1)[0]
        self.stop()
        raise AssertionError("the server did not start:\n" + "".join(self.output))

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **({"api_key": "none"} | kwargs))

    def request(self, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
        """A raw HTTP request (POST with a body): the status and the JSON answer."""
        request = urllib.request.Request(f"{self.url}{path}", data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def health(self) -> dict:
        status, body = self.request("/health")
        assert status == 200
        return body

    def wait_for(self, condition, seconds: float = 30) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            health = self.health()
            if condition(health):
                return health
            time.sleep(0.05)
        raise AssertionError(f"not reached in {seconds} s: {self.health()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random checkpoint, with a chat template added to its config."""
    weights = make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)
    config = dataclasses.replace(load_checkpoint_config(weights.parent), chat_template=TEMPLATE)
    (weights.parent / "config.json").write_text(config.to_json())
    return weights.parent


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    args = ("--max_batch", "4", "--max_seq_length", "256", "--api_key", KEY, "--model_name", "tiny")
    server = Server("--checkpoint_path", str(tiny_dir), *args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scarce_server(tiny_dir):
    """The tiny model with a paged cache of 28 blocks of 4 tokens, barely one sequence of 96: requests are preempted
    and resumed, prompts find their prefixes cached, long prompts go in by chunks of 8, and steps run 2 or 4
    rows."""
    cache = ("--block_size", "4", "--kv_cache_tokens", "112", "--prefill_chunk", "8", "--step_sizes", "2")
    args = ("--max_batch", "4", "--max_seq_length", "96", *cache, "--api_key", KEY, "--model_name", "tiny")
    server = Server("--checkpoint_path", str(tiny_dir), *args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smol_server(smollm2_checkpoint):
    """The default model: two slots, no queue (a third request at once is refused)."""
    args = ("--max_batch", "2", "--max_queue", "0", "--max_seq_length", "512", "--model_name", SMOL)
    server = Server("--checkpoint_path", str(smollm2_checkpoint), *args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    with one_torch_thread():
        yield Engine.load(tiny_dir, device="cpu")


def generated(argv, tmp_path, capsys) -> dict:
    """`gpt-fast generate ARGV --temperature 0 --num_samples 1`'s metrics."""
    metrics = tmp_path / "metrics.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv, "--temperature", "0", "--num_samples", "1", "--metrics_json", str(metrics)])
    assert exit_info.value.code == 0, capsys.readouterr().err
    return json.loads(metrics.read_text())


def streamed(stream) -> tuple[str, list, dict | None]:
    """A stream's text, finish reasons and usage."""
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, reasons, usage


def test_models_and_health(tiny_server):
    models = tiny_server.client(api_key=KEY).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = tiny_server.health()
    assert health["status"] == "ok" and health["slots"] == 4 and health["model"] == "tiny"
    assert set(health["cache"]) == {field.name for field in dataclasses.fields(CacheUsage)}


def test_completions_equal_gpt_fast_generate(tiny_server, tiny_dir, tmp_path, capsys):
    prompt = "The capital of France is"
    metrics = generated(
        ["--checkpoint_path", str(tiny_dir), "--prompt", prompt, "--max_new_tokens", "20"], tmp_path, capsys
    )
    expected_ids, expected_text = metrics["samples"][0]["generated_ids"][0], metrics["samples"][0]["text"][0]
    client = tiny_server.client(api_key=KEY)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert answer.choices[0].text == expected_text
    assert answer.usage.prompt_tokens == len(metrics["prompt_ids"])
    assert answer.usage.completion_tokens == len(expected_ids)
    assert answer.usage.total_tokens == len(metrics["prompt_ids"]) + len(expected_ids)
    assert answer.choices[0].finish_reason == ("stop" if expected_ids[-1] == 257 else "length")
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, reasons, usage = streamed(stream)
    assert text == expected_text and reasons == [answer.choices[0].finish_reason] and usage == answer.usage


def test_chat_on_the_default_model_equals_gpt_fast_generate(smol_server, smollm2_checkpoint, tmp_path, capsys):
    system, question = "You answer in one short sentence.", "What is the capital of France?"
    argv = ["--checkpoint_path", str(smollm2_checkpoint), "--chat", "--system", system, "--prompt", question]
    metrics = generated([*argv, "--max_new_tokens", "24"], tmp_path, capsys)
    expected_ids, expected_text = metrics["samples"][0]["generated_ids"][0], metrics["samples"][0]["text"][0]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    client = smol_server.client()
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in expected_text and answer.choices[0].message.content == expected_text
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(metrics["prompt_ids"])
    assert answer.usage.completion_tokens == len(expected_ids)
    assert answer.choices[0].finish_reason == ("stop" if len(expected_ids) < 24 else "length")
    stream = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=24, temperature=0, stream=True
    )
    text, reasons, usage = streamed(stream)
    assert text == expected_text and reasons == [answer.choices[0].finish_reason] and usage is None


def test_the_serving_guides_client_example_runs_as_written(smol_server, capsys):
    section = (REPO / "docs" / "serving.md").read_text()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(code.replace("http://127.0.0.1:8000", smol_server.url), {})  # the guide's own code
    out = capsys.readouterr().out
    assert re.search(r"\n\d+ tokens\n$", out) and len(out) > 40


def test_stop_strings_stop_tokens_and_max_tokens(tiny_server, tiny_engine):
    client = tiny_server.client(api_key=KEY)
    prompt = "Hello, my name is"
    ids = tiny_engine.encode(prompt)
    free = tiny_engine.generate_ids(ids, 30, SamplingConfig(temperature=0), ignore_eos=True).tokens[0]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop_text = text[len(stream_text(tiny_engine, ids, free[:12])) :][:2]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop_text, "\x00"])
    assert cut.choices[0].text == text[: text.index(stop_text)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 30
    stop_id = free[8]
    by_id = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop_id])
    assert by_id.usage.completion_tokens == free.index(stop_id) + 1 and by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].text == stream_text(tiny_engine, ids, free[: free.index(stop_id)])
    short = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert short.usage.prompt_tokens == len(ids)


def test_a_seed_makes_sampling_reproducible(tiny_server):
    client = tiny_server.client(api_key=KEY)

    def sample(seed, **kwargs):
        return (
            client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0, seed=seed, **kwargs)
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first and sample(7, top_p=1.0) == first and sample(8) != first
    assert (
        streamed(client.completions.create(model="tiny", prompt="Once", max_tokens=16, seed=7, stream=True))[0] == first
    )


def test_logprobs(tiny_server):
    client = tiny_server.client(api_key=KEY)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == item.top_logprobs[0].logprob  # greedy: the best
        assert item.logprob <= 0 and item.bytes == list(item.token.encode("utf-8", "replace"))
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": CHAT_MESSAGES}
TEXTS = ["The capital of France is", "def f(x):\n    return x * 2", "naïve café 🤖", "<|im_start|>user"]


def test_tokenize_and_detokenize_as_transformers_does(smol_server, smollm2_hf_tokenizer):
    """vLLM's /tokenize and /detokenize on the default model against transformers' tokenizer of the same GGUF."""
    reference = smollm2_hf_tokenizer
    for text in TEXTS:
        status, answer = smol_server.request("/tokenize", json.dumps({"prompt": text}).encode())
        assert status == 200 and answer["tokens"] == reference(text)["input_ids"], (text, answer)
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 512
        assert answer["token_strs"] is None
        status, back = smol_server.request("/detokenize", json.dumps({"tokens": answer["tokens"]}).encode())
        assert status == 200 and back == {"prompt": reference.decode(answer["tokens"])}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = {"model": SMOL, "messages": messages, "return_token_strs": True}
    status, answer = smol_server.request("/tokenize", json.dumps(body).encode())
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert status == 200 and answer["tokens"] == list(getattr(expected, "input_ids", expected))
    assert answer["token_strs"] == [reference.decode([i]) for i in answer["tokens"]]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "hi", "messages": CHAT_MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": ["hi"]}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT_MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}, "model"),
        ("/tokenize", {"prompt": "hi", "truncate": 3}, "truncate"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ],
)
def test_bad_tokenize_requests_get_openai_errors(tiny_server, tiny_engine, path, body, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, answer = tiny_server.request(path, json.dumps(body).encode(), headers)
    assert status in (400, 404) and answer["error"]["param"] == param, answer
    status, answer = tiny_server.request("/tokenize", json.dumps({"prompt": "hi"}).encode())
    assert status == 401  # the server's key is asked for here too
    text = "Hello, world"
    body = {"prompt": text, "add_special_tokens": False}
    status, answer = tiny_server.request("/tokenize", json.dumps(body).encode(), headers)
    assert status == 200 and answer["tokens"] == tiny_engine.tokenizer.encode(text, bos=False)


def test_openai_fields_that_change_nothing_are_accepted_and_logged_once(tiny_server):
    client = tiny_server.client(api_key=KEY)
    extra = {"metadata": {"purpose": "test"}, "store": True, "service_tier": "auto", "user": "u-1"}
    answers = [
        client.chat.completions.create(model="tiny", messages=CHAT_MESSAGES, max_tokens=4, temperature=0,
                                       parallel_tool_calls=False, **extra).choices[0].message.content,
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0,
                                  extra_body=extra).choices[0].text,  # the client's legacy call names fewer
    ]  # fmt: skip
    plain = client.chat.completions.create(model="tiny", messages=CHAT_MESSAGES, max_tokens=4, temperature=0)
    assert answers[0] == plain.choices[0].message.content and all(isinstance(a, str) for a in answers)
    notes = [line for line in tiny_server.output if line.startswith("note: the OpenAI field")]
    for name in (*extra, "parallel_tool_calls"):
        assert sum(f"{name!r}" in line for line in notes) == 1, notes


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(tiny_server, tiny_engine):
    """`echo` + `logprobs` with `max_tokens: 0`: the prompt's tokens with the engine's own log-likelihoods, the
    first one null as OpenAI gives it; then with new tokens after them."""
    client = tiny_server.client(api_key=KEY)
    prompt = "The quick brown fox jumps"
    ids = tiny_engine.encode(prompt)
    expected = tiny_engine.log_likelihoods(ids).tolist()
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for token_logprob, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
        assert len(top) <= 2 and max(top.values()) >= token_logprob - 1e-5
    assert "".join(logprobs.tokens) == tiny_engine.tokenizer.decode(ids)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(ids))]
    more = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert more.choices[0].text == prompt + plain.choices[0].text
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 3
    assert more.choices[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    text, reasons, _ = streamed(
        client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=3, temperature=0, stream=True)
    )
    assert text == more.choices[0].text and reasons == [more.choices[0].finish_reason]


def test_several_prompts_in_one_completions_request(tiny_server, tiny_engine):
    """A choice per prompt, in order, each what that prompt alone gets; lm-evaluation-harness's log-likelihood
    request (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`) included."""
    client = tiny_server.client(api_key=KEY)
    prompts = ["Once upon a time", tiny_engine.encode("Hello"), "1, 2, 3,"]
    answer = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0) for p in prompts]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [a.choices[0].text for a in alone]
    assert answer.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    contexts = [tiny_engine.encode(text) for text in ("The answer is", "Paris is in")]
    scored = client.completions.create(
        model="tiny", prompt=contexts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for ids, choice in zip(contexts, scored.choices, strict=True):
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        assert choice.logprobs.token_logprobs[1:-1] == pytest.approx(
            tiny_engine.log_likelihoods(ids).tolist(), abs=1e-4
        )


def test_n_choices_with_a_seed_are_reproducible(tiny_server):
    """`n` choices per prompt, seeded seed, seed + 1, ...: the same answers again, the first one n = 1's, streamed
    the same, and one prompt's choices before the next prompt's."""
    client = tiny_server.client(api_key=KEY)
    ask = {"model": "tiny", "messages": CHAT_MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 11}
    first = client.chat.completions.create(n=3, **ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [c.message.content for c in client.chat.completions.create(n=3, **ask).choices] == texts
    assert client.chat.completions.create(**ask).choices[0].message.content == texts[0]
    by_index: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=3, stream=True, **ask):
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert [by_index[i] for i in range(3)] == texts
    both = client.completions.create(model="tiny", prompt=["Once", "Twice"], n=2, max_tokens=6, seed=3)
    alone = [client.completions.create(model="tiny", prompt=p, n=2, max_tokens=6, seed=3) for p in ("Once", "Twice")]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]


def test_logit_bias_and_penalties_change_the_answer(tiny_server, tiny_engine):
    client = tiny_server.client(api_key=KEY)
    ask = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    greedy = tiny_engine.generate_ids(tiny_engine.encode("Hello"), 8, SamplingConfig(temperature=0), ignore_eos=True)
    plain = set(greedy.tokens[0])
    assert len(plain) < 8  # the greedy answer repeats a token: what the penalties act on

    def answer(**extra) -> list[str]:
        return client.completions.create(**ask, **extra).choices[0].logprobs.tokens

    (token,) = tiny_engine.tokenizer.encode("Q", bos=False)
    assert answer(logit_bias={str(token): 100}) == ["Q"] * 8
    banned = answer(logit_bias={str(t): -100 for t in plain})
    texts = {tiny_engine.tokenizer.decode([t]) for t in plain} - {"\ufffd"}  # byte tokens of no text share "\ufffd"
    assert texts and not set(banned) & texts
    penalized = answer(presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(penalized)) > len(plain)


def test_the_key_is_required(tiny_server):
    for client in (tiny_server.client(), tiny_server.client(api_key="wrong")):
        with pytest.raises(openai.AuthenticationError) as err:
            client.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert tiny_server.request("/health")[0] == 200  # the health check and the page need no key


LONG = "x" * 300  # 301 tokens with BOS: longer than the 256 tokens of a slot


@pytest.mark.parametrize(
    "path, body, status, expected",
    [
        ("/v1/chat/completions", CHAT | {"model": "gpt-4o"}, 404, {"code": "model_not_found", "param": "model"}),
        ("/v1/chat/completions", CHAT | {"n": 17}, 400, {"param": "n"}),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"600": 5}}, 400, {"param": "logit_bias"}),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"1": 101}}, 400, {"param": "logit_bias"}),
        ("/v1/chat/completions", CHAT | {"presence_penalty": 2.5}, 400, {"param": "presence_penalty"}),
        ("/v1/chat/completions", CHAT | {"min_p": -0.1}, 400, {"param": "min_p"}),
        ("/v1/chat/completions", CHAT | {"temperature": 2.5}, 400, {"param": "temperature"}),
        ("/v1/chat/completions", CHAT | {"top_p": "high"}, 400, {"param": "top_p"}),
        ("/v1/chat/completions", CHAT | {"top_k": 0}, 400, {"param": "top_k"}),
        ("/v1/chat/completions", CHAT | {"stop": [""]}, 400, {"param": "stop"}),
        ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}}, 400, {"param": "stream_options"}),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, {"param": "top_logprobs"}),
        ("/v1/chat/completions", CHAT | {"frequency_penalty": "a lot"}, 400, {"param": "frequency_penalty"}),
        ("/v1/chat/completions", CHAT | {"metadata": ["a"]}, 400, {"param": "metadata"}),
        ("/v1/chat/completions", CHAT | {"store": "yes"}, 400, {"param": "store"}),
        ("/v1/chat/completions", CHAT | {"service_tier": 1}, 400, {"param": "service_tier"}),
        ("/v1/chat/completions", CHAT | {"tools": []}, 400, {"param": "tools"}),
        ("/v1/chat/completions", CHAT | {"messages": []}, 400, {"param": "messages"}),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "robot", "content": "hi"}]}, 400, {}),
        ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, {"param": "model"}),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": LONG}]}, 400,
         {"code": "context_length_exceeded"}),
        ("/v1/completions", {"model": "tiny", "prompt": LONG}, 400, {"code": "context_length_exceeded"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 300}, 400,
         {"code": "context_length_exceeded", "param": "max_tokens"}),
        ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 65}, 400, {"param": "prompt"}),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", 1]}, 400, {"param": "prompt"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, {"param": "max_tokens"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": "yes"}, 400, {"param": "echo"}),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 512]}, 400, {"param": "prompt"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "suffix": "!"}, 400, {"param": "suffix"}),
        ("/v1/completions", [1, 2], 400, {}),
        ("/v1/embeddings", {"model": "tiny"}, 404, {}),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(tiny_server, path, body, status, expected):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    got, answer = tiny_server.request(path, json.dumps(body).encode(), headers)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert {key: error[key] for key in expected} == expected


def test_bodies_that_are_not_json_or_too_large(tiny_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    status, answer = tiny_server.request("/v1/completions", b'{"model": "tiny", ', headers)
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    host, port = tiny_server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", str(5 << 20))  # refused on its announced size, before it is sent
    connection.putheader("Authorization", f"Bearer {KEY}")
    connection.endheaders(b"{")
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["type"] == "invalid_request_error"
    connection.close()


def test_unknown_model_through_the_client(tiny_server):
    with pytest.raises(openai.NotFoundError) as err:
        tiny_server.client(api_key=KEY).chat.completions.create(model="nope", messages=CHAT["messages"])
    assert err.value.body["code"] == "model_not_found"


def test_a_full_server_refuses_and_a_client_going_away_frees_its_slot(smol_server):
    """Two long streams hold both slots: a third request is refused (503, no queue). The first client goes away
    mid-stream: its slot is freed at once, and the next request gets it while the second stream goes on."""
    client = smol_server.client()
    model = client.models.list().data[0].id
    before = smol_server.health()["tokens_generated"]
    long = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    first, second = client.completions.create(**long), client.completions.create(**long)
    next(iter(first)), next(iter(second))  # both are decoding
    smol_server.wait_for(lambda h: h["busy"] == 2)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and err.value.body["code"] == "queue_full"
    assert err.value.response.headers["retry-after"] == "1"
    first.close()
    smol_server.wait_for(lambda h: h["busy"] == 1)
    answer = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    assert smol_server.health()["busy"] == 1  # the second stream still decodes
    second.close()
    health = smol_server.wait_for(lambda h: h["busy"] == 0)
    assert health["tokens_generated"] - before < 400  # neither long stream ran to its end


@pytest.mark.slow
def test_ctrl_c_ends_the_streams_in_flight_and_stops_the_server(smollm2_checkpoint):
    """SIGINT (Ctrl-C) while a stream decodes: the stream gets its end at once (an error event, then [DONE]: the
    server is shutting down), and the server exits as an interrupted command does (`error: interrupted`, 130)."""
    args = ("--max_batch", "1", "--max_seq_length", "512", "--model_name", SMOL)
    server = Server("--checkpoint_path", str(smollm2_checkpoint), *args)
    try:
        long = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
        chunks = iter(server.client().completions.create(**long, extra_body={"ignore_eos": True}))
        next(chunks)
        assert server.health()["busy"] == 1
        server.process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            list(chunks)
        assert server.process.wait(60) == 130
    finally:
        server.stop()
    server.drain.join(60)
    assert "".join(server.output).endswith("error: interrupted\n")


def test_signals_call_stop_and_are_raised_again_after_the_block():
    """Inside the block Ctrl-C calls ``stop`` (once) and a second one interrupts; after it, the first is raised
    again, so that the command ends as an interrupted one does; the handlers are restored."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    calls = []
    with pytest.raises(KeyboardInterrupt), signals_call(lambda: calls.append("stop")):
        signal.raise_signal(signal.SIGINT)
        calls.append("went on")
    assert calls == ["stop", "went on"]
    with pytest.raises(KeyboardInterrupt), signals_call(lambda: calls.append("stop")):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        calls.append("not reached")
    assert calls == ["stop", "went on", "stop"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("server_name", ["tiny_server", "scarce_server"])
def test_many_clients_at_once_each_get_their_own_answer(server_name, request, tiny_engine):
    """16 clients x 20 requests of different prompts and lengths, streamed and not, at once through 4 slots, after
    a stream each client leaves after its first tokens: each answer is the same request's greedy answer alone, none
    lost, duplicated or mixed with another; the server answers /health all along. On the scarce cache requests are
    preempted and prompts found cached, and every block comes back once the clients are gone."""
    tiny_server = request.getfixturevalue(server_name)
    before = tiny_server.health()["cache"]
    prompts = [f"{word} number {i}:" * (1 + i % 3) for i, word in enumerate(["alpha", "beta", "gamma", "delta"] * 20)]
    longest = 14
    reference = {}
    for prompt in prompts:
        ids = tiny_engine.encode(prompt)
        reference[prompt] = (ids, tiny_engine.generate_ids(ids, longest, SamplingConfig(temperature=0)).tokens[0])
    jobs = [
        [(prompts[(c * 20 + r) % 80], 1 + (c + r) % longest, (c + r) % 2 == 0) for r in range(20)] for c in range(16)
    ]
    health_codes, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            health_codes.append(tiny_server.request("/health")[0])
            time.sleep(0.05)

    def client_session(requests):
        client = tiny_server.client(api_key=KEY)
        left = client.completions.create(model="tiny", prompt=requests[0][0], max_tokens=40, temperature=0, stream=True)
        next(iter(left))
        left.close()  # the client goes away: its request is cancelled and its blocks freed
        answers = []
        for prompt, max_tokens, stream in requests:
            kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if stream:
                text, reasons, usage = streamed(
                    client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
                )
            else:
                answer = client.completions.create(**kwargs)
                text, reasons, usage = answer.choices[0].text, [answer.choices[0].finish_reason], answer.usage
            answers.append((prompt, max_tokens, text, reasons, usage.completion_tokens))
        return answers

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            sessions = list(pool.map(client_session, jobs, timeout=300))
    finally:
        stop.set()
        watcher.join()
    assert sum(len(s) for s in sessions) == 320 and set(health_codes) == {200} and len(health_codes) > 1
    after = tiny_server.wait_for(lambda health: health["busy"] == 0 and health["cache"]["blocks_used"] == 0)["cache"]
    if server_name == "scarce_server":
        said = "KV cache: paged, 28 blocks of 4 tokens (112 tokens, 0.00 GiB of float32), prefix caching on\n"
        assert said in tiny_server.output
        assert any(line.startswith("Warm-up (the steps for 2, 4 slots") for line in tiny_server.output)
        assert after["preemptions"] > before["preemptions"]
        assert after["prefix_tokens_hit"] > before["prefix_tokens_hit"]
    for requests, answers in zip(jobs, sessions, strict=True):
        assert [a[:2] for a in answers] == [r[:2] for r in requests]
        for prompt, max_tokens, text, reasons, completion_tokens in answers:
            ids, free = reference[prompt]
            expected = free[:max_tokens]
            if 257 in expected:
                expected = expected[: expected.index(257) + 1]
            assert completion_tokens == len(expected)
            assert text == stream_text(tiny_engine, ids, [t for t in expected if t != 257])
            assert reasons == ["stop" if expected[-1] == 257 else "length"]


def stream_text(engine, prompt_ids, ids) -> str:
    """The text a stream of ``ids`` gives, ended: what the server sends (as `Engine.stream` would)."""
    pieces = []
    stream = TextStream(engine.tokenizer, prompt_ids, pieces.append)
    for token in ids:
        stream.push(token)
    stream.flush()
    return "".join(pieces)


def chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("needs chromium and chromedriver (./scripts/setup.sh --dev installs them)")
    return browser, driver


@pytest.mark.slow
def test_the_chat_page_streams_an_answer_and_stops_it(smol_server, tmp_path):
    """In a headless Chromium: type a message, see the answer stream in, press stop; the tokens/sec are shown. Then
    with a JSON schema in its box: the answer comes pretty-printed and said to match the schema (checked here by
    jsonschema too). Screenshots are kept in test-artifacts/ (GPT_FAST_TEST_ARTIFACTS)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,720",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.get(smol_server.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "model").text.startswith("model: "))
        driver.find_element(By.ID, "system").send_keys("You are a helpful assistant.")
        temperature = driver.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        driver.find_element(By.ID, "input").send_keys("Tell me a long story about a dragon.")
        driver.find_element(By.ID, "send").click()
        answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant.streaming .content"))
        wait.until(lambda d: len(answer.text.split()) >= 8)  # the answer streams in
        driver.find_element(By.ID, "stop").click()
        stats = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant.done .stats"))
        assert "tokens/s" in stats.text and stats.text.endswith("stopped"), stats.text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "chat_page.png"))
        smol_server.wait_for(lambda h: h["busy"] == 0)  # stopping in the page freed the slot
        answer_with_a_schema(driver, wait)
        driver.execute_script("document.querySelector('aside').scrollTop = 0")
        driver.save_screenshot(str(ARTIFACTS / "chat_page_json.png"))
    finally:
        driver.quit()


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["city", "country", "rank"],
    "additionalProperties": False,
}


def answer_with_a_schema(driver, wait) -> None:
    """The page's JSON schema box: a schema that is not JSON is refused in the page; a schema holds the answer, which
    is pretty-printed and said to match."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "clear").click()
    schema = driver.find_element(By.ID, "schema")
    schema.send_keys("{not json")
    driver.find_element(By.ID, "input").send_keys("Name a big city.")
    driver.find_element(By.ID, "send").click()
    refused = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .stats.error"))
    assert "the JSON schema is not JSON" in refused.text
    driver.find_element(By.ID, "clear").click()
    schema.clear()
    schema.send_keys(json.dumps(SCHEMA))
    driver.find_element(By.ID, "input").send_keys("Name a big city.")
    driver.find_element(By.ID, "send").click()
    verdict = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant.done .stats")[1:])[0]
    content = driver.find_element(By.CSS_SELECTOR, ".assistant.json .content").text
    assert verdict.text == "valid: matches the schema", verdict.text
    jsonschema.validate(json.loads(content), SCHEMA)
    assert content == json.dumps(json.loads(content), indent=2, ensure_ascii=False)
