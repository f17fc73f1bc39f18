"""Continuous batching: requests prefilled apart and decoded together give what each gives alone (greedy, or sampled
with a seed), stop where they should, free their slots when they finish or are cancelled, and tell of their tokens with
the model's log-probabilities. The reference is the single-stream loop of :mod:`gpt_fast.generation.decode` and the
model's full forward."""

from __future__ import annotations

import dataclasses
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpt_fast import Engine, EngineOptions, SamplingConfig
from gpt_fast.convert.random_init import make_random_checkpoint, random_weights
from gpt_fast.engine.batcher import Delta, Failed, Finished, QueueFull, Request
from gpt_fast.engine.options import BatchOptions, step_rows
from gpt_fast.generation.options import SpeculativeOptions
from gpt_fast.generation.slots import make_slot_steps
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.options import OptionError

GREEDY = SamplingConfig(temperature=0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95)
PROMPTS = ["hello", "The quick brown fox jumps over", "a", "1, 2, 3, 4, 5, 6, 7, 8", "café ☕", "def f(x):", "zz"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)
    return Engine.load(path, device="cpu")


class Events:
    """What a request was told, in order."""

    def __init__(self) -> None:
        self.items: list = []

    def __call__(self, event) -> None:
        self.items.append(event)

    @property
    def finished(self) -> Finished:
        (done,) = [e for e in self.items if isinstance(e, Finished)]
        assert self.items[-1] is done
        return done

    @property
    def deltas(self) -> list[Delta]:
        return [e for e in self.items if isinstance(e, Delta)]


def run_all(engine, requests, **options):
    return run_batcher(engine.batcher(BatchOptions(**({"max_batch": 3, "max_seq_length": 128} | options))), requests)


def run_batcher(batcher, requests):
    events = [Events() for _ in requests]
    for request, sink in zip(requests, events, strict=True):
        batcher.submit(request, sink)
    batcher.run()
    return [sink.finished for sink in events]


def alone(engine, ids, max_new_tokens):
    return engine.generate_ids(ids, max_new_tokens, GREEDY).tokens[0]


def test_greedy_requests_decoded_together_equal_each_alone(engine):
    """Seven prompts of different lengths and budgets through three slots (four wait their turn)."""
    prompts = [engine.encode(text) for text in PROMPTS]
    budgets = [5, 17, 1, 9, 12, 3, 20]
    done = run_all(engine, [Request(tuple(p), n, GREEDY) for p, n in zip(prompts, budgets, strict=True)])
    for ids, budget, finished in zip(prompts, budgets, done, strict=True):
        expected = alone(engine, ids, budget)
        assert list(finished.ids) == expected
        assert finished.finish_reason == ("stop" if expected[-1] in engine.stop_ids else "length")
        assert finished.prompt_tokens == len(ids) and finished.completion_tokens == len(expected)
        assert finished.text == engine.decode(expected) and finished.ttft_seconds <= finished.seconds


def test_a_step_runs_the_fewest_rows_that_hold_every_busy_slot(engine):
    """With step sizes 1, 2 and 5 of 5 slots: the steps take 1, 2 or 5 rows as requests come and go (slots taken
    lowest first), and every answer is its greedy run alone."""
    prompts = [engine.encode(text) for text in PROMPTS[:5]]
    budgets = [30, 12, 8, 4, 3]
    batcher = engine.batcher(BatchOptions(max_batch=5, max_seq_length=128, step_sizes=(2, 1)))
    decode, rows_run = batcher.steps.decode, []

    def counted(model, state, rows, **masked):
        busy = [slot for slot, job in enumerate(batcher.slots) if job is not None]
        rows_run.append((rows, max(busy) + 1))
        decode(model, state, rows, **masked)

    batcher.steps = dataclasses.replace(batcher.steps, decode=counted)
    events = [Events() for _ in prompts]
    for ids, budget, sink in zip(prompts, budgets, events, strict=True):
        batcher.submit(Request(tuple(ids), budget, GREEDY), sink)
    batcher.run()
    for ids, budget, sink in zip(prompts, budgets, events, strict=True):
        assert list(sink.finished.ids) == alone(engine, ids, budget)
    assert {rows for rows, _ in rows_run} == {1, 2, 5}
    assert all(rows == next(size for size in (1, 2, 5) if size >= last) for rows, last in rows_run)


def test_a_free_slot_stays_at_position_zero(engine):
    """After warm-up every slot is free at position 0; a slot that no request took stays there while the others
    decode (its attention reads one position), and a slot whose request ended goes back to it."""
    batcher = engine.batcher(BatchOptions(max_batch=3, max_seq_length=128))
    batcher.warm_up()
    assert not batcher.state.live.any() and not batcher.state.input_pos.any()
    decode, unused = batcher.steps.decode, []

    def watched(model, state, rows, **masked):
        decode(model, state, rows, **masked)
        unused.append(int(state.input_pos[2]))

    batcher.steps = dataclasses.replace(batcher.steps, decode=watched)
    requests = [Request(tuple(engine.encode(text)), n, GREEDY) for text, n in (("hello", 3), ("a", 12))]
    done = run_batcher(batcher, requests)
    assert [list(f.ids) for f in done] == [alone(engine, list(r.prompt_ids), r.max_new_tokens) for r in requests]
    assert len(unused) > 10 and set(unused) == {0}
    slots = slice(0, 3)  # the rows after them are where prompts are prefilled together
    assert not batcher.state.live[slots].any() and not batcher.state.input_pos[slots].any()


def test_the_step_sizes_unless_told_are_1_8_and_32_below_max_batch_or_powers_of_two_eager():
    assert step_rows(BatchOptions(max_batch=64)) == (1, 8, 32, 64)
    assert step_rows(BatchOptions(max_batch=8)) == (1, 8)
    assert step_rows(BatchOptions(max_batch=1)) == (1,)
    assert step_rows(BatchOptions(max_batch=5, step_sizes=(2,))) == (2, 5)
    assert step_rows(BatchOptions(max_batch=8), compiled=False) == (1, 2, 4, 8)
    assert step_rows(BatchOptions(max_batch=6), compiled=False) == (1, 2, 4, 6)
    assert step_rows(BatchOptions(max_batch=5, step_sizes=(2,)), compiled=False) == (2, 5)


def test_step_sizes_are_checked():
    with pytest.raises(OptionError, match="step_sizes must be an integer in 1..4, got 5"):
        BatchOptions(max_batch=4, step_sizes=(2, 5))


def test_a_seed_gives_the_same_tokens_whatever_else_is_decoded(engine):
    prompt = tuple(engine.encode("Once upon a time"))
    seeded = Request(prompt, 24, SAMPLED, seed=1234)
    (by_itself,) = run_all(engine, [seeded])
    others = [Request(tuple(engine.encode(text)), 30, SAMPLED) for text in PROMPTS[:4]]
    crowded = run_all(engine, [*others[:2], seeded, *others[2:]], max_batch=4)
    assert crowded[2].ids == by_itself.ids
    (other_seed,) = run_all(engine, [dataclasses.replace(seeded, seed=1235)])
    assert other_seed.ids != by_itself.ids


def test_stop_tokens_and_stop_strings_end_a_request(engine):
    prompt = tuple(engine.encode("The quick brown fox jumps over"))
    free = alone(engine, list(prompt), 30)
    text = engine.decode(free)
    stop_id = free[6]
    stop_text = text[len(engine.decode(free[:10])) :][:3]  # text that starts after the tenth token
    by_id, by_text = run_all(
        engine, [Request(prompt, 30, GREEDY, stop_ids=(stop_id,)), Request(prompt, 30, GREEDY, stop_texts=(stop_text,))]
    )
    assert list(by_id.ids) == free[: free.index(stop_id) + 1] and by_id.finish_reason == "stop"
    assert by_id.text == engine.decode(free[: free.index(stop_id)])  # the stop token's text is left out
    assert by_text.finish_reason == "stop" and by_text.text == text[: text.index(stop_text)]
    assert list(by_text.ids) == free[: len(by_text.ids)] and len(by_text.ids) < 30


def test_the_streamed_text_is_the_whole_text(engine):
    done = run_all(engine, [Request(tuple(engine.encode("hi")), 40, SAMPLED, seed=1)])
    sink = Events()
    batcher = engine.batcher(BatchOptions(max_batch=2, max_seq_length=128))
    batcher.submit(Request(tuple(engine.encode("hi")), 40, SAMPLED, seed=1), sink)
    batcher.run()
    assert "".join(d.text for d in sink.deltas) == sink.finished.text == done[0].text
    assert [d.token for d in sink.deltas] == list(done[0].ids)


def test_logprobs_are_the_models_own(engine):
    """Each token's log-probability, and the best alternatives', are those of a full forward over the sequence."""
    prompt = engine.encode("abc")
    sink = Events()
    batcher = engine.batcher(BatchOptions(max_batch=2, max_seq_length=64))
    batcher.submit(Request(tuple(prompt), 6, SAMPLED, seed=3, top_logprobs=4), sink)
    batcher.run()
    ids = list(sink.finished.ids)
    engine.model.setup_caches(1, 64)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + ids]), torch.arange(len(prompt) + len(ids)))[0]
    logprobs = logits[len(prompt) - 1 : -1].log_softmax(-1)  # [new tokens, V]: the distribution of each new token
    for step, delta in enumerate(sink.deltas):
        best = logprobs[step].topk(4)
        assert delta.logprob.token == ids[step] and delta.logprob.text == engine.tokenizer.decode([ids[step]])
        assert delta.logprob.logprob == pytest.approx(float(logprobs[step, ids[step]]), abs=1e-4)
        assert [t for t, _, _ in delta.logprob.top] == best.indices.tolist()
        assert [lp for _, _, lp in delta.logprob.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_the_decode_step_runs_the_fewest_rows_that_hold_every_busy_slot(engine):
    """Eager steps take every power of two up to ``max_batch``: two busy slots run 2 rows of 4."""
    steps = make_slot_steps("none")
    rows_seen = []

    def decode(model, state, rows):
        rows_seen.append(rows)
        steps.decode(model, state, rows)

    batcher = engine.batcher(BatchOptions(max_batch=4, max_seq_length=64))
    batcher.steps = dataclasses.replace(steps, decode=decode)
    batcher.submit(Request(tuple(engine.encode("a")), 4, GREEDY), Events())
    batcher.run()
    assert set(rows_seen) == {1}
    rows_seen.clear()
    for text in ("a", "b"):
        batcher.submit(Request(tuple(engine.encode(text)), 4, GREEDY), Events())
    batcher.run()
    assert set(rows_seen) == {2}


def test_a_cancelled_request_frees_its_slot_for_the_next(engine):
    batcher = engine.batcher(BatchOptions(max_batch=1, max_seq_length=128))
    first, second = Events(), Events()
    long_job = batcher.submit(Request(tuple(engine.encode("a")), 100, GREEDY, ignore_eos=True), first)
    waiting = batcher.submit(Request(tuple(engine.encode("b")), 3, GREEDY, ignore_eos=True), second)
    for _ in range(5):
        batcher.step()
    assert long_job.slot == 0 and waiting.slot is None and batcher.queued == 1
    batcher.cancel(long_job)
    batcher.step()
    assert waiting.slot == 0 and first.finished.finish_reason == "cancelled"
    assert len(first.finished.ids) < 10
    batcher.run()
    assert second.finished.finish_reason == "length" and len(second.finished.ids) == 3
    assert batcher.busy == 0 and batcher.queued == 0


def test_a_full_queue_refuses_more(engine):
    batcher = engine.batcher(BatchOptions(max_batch=1, max_seq_length=64, max_queue=1))
    request = Request(tuple(engine.encode("a")), 2, GREEDY)
    batcher.submit(request, Events())
    batcher.submit(request, Events())
    with pytest.raises(QueueFull, match="all 1 slots are busy"):
        batcher.submit(request, Events())
    batcher.run()
    batcher.submit(request, Events())  # room again


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt_ids": ()}, "the prompt is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 62}, r"prompt \(3 tokens\) \+ max_new_tokens \(62\) = 65 exceeds the context of 64"),
        ({"prompt_ids": (1, 512)}, "token ids must be integers in 0..511"),
        ({"stop_ids": (-1,)}, "token ids must be integers in 0..511"),
        ({"top_logprobs": 21}, "top_logprobs must be an integer in 0..20"),
        ({"stop_texts": ("",)}, "stop strings must be non-empty"),
    ],
)
def test_requests_that_cannot_be_served(engine, change, message):
    batcher = engine.batcher(BatchOptions(max_batch=1, max_seq_length=64))
    with pytest.raises(ValueError, match=message):
        batcher.submit(dataclasses.replace(Request((1, 2, 3), 4), **change), Events())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_batch": 0}, "^max_batch must be an integer in 1..64"),
        ({"max_batch": 65}, "^max_batch must be an integer in 1..64"),
        ({"max_queue": -1}, "^max_queue must be an integer >= 0"),
        ({"max_seq_length": 1}, "^max_seq_length must be an integer >= 2"),
    ],
)
def test_batch_options_check_themselves(options, message):
    with pytest.raises(ValueError, match=message):
        BatchOptions(**options)


def test_a_cache_longer_than_the_context_is_refused(engine):
    with pytest.raises(ValueError, match="max_seq_length 513 exceeds the model's context of 512"):
        engine.batcher(BatchOptions(max_seq_length=513))


def test_serving_in_this_thread_while_a_client_thread_submits(engine):
    """The batcher serves in the calling thread while the clients submit from a thread of their own; a failed step
    fails the requests in the slots and the next ones are served; serving ends when the clients return."""
    batcher = engine.batcher(BatchOptions(max_batch=2, max_seq_length=64))
    serving = threading.current_thread()
    stepped_in, ends = set(), {}
    real_step = batcher.step

    def step():
        stepped_in.add(threading.current_thread())
        real_step()

    batcher.step = step

    def submit_and_wait(name, text):
        ends[name] = events = Events()
        assert submit(batcher, Request(tuple(engine.encode(text)), 5, GREEDY), events).wait(60)

    def clients():
        submit_and_wait("first", "x")
        real_decode = batcher.steps.decode

        def broken(*args):
            batcher.steps = dataclasses.replace(batcher.steps, decode=real_decode)
            raise RuntimeError("device lost")

        batcher.steps = dataclasses.replace(batcher.steps, decode=broken)
        submit_and_wait("broken", "y")
        submit_and_wait("after", "z")

    batcher.serve_while(clients, timeout=60)
    assert stepped_in == {serving}
    assert list(ends["first"].finished.ids) == alone(engine, engine.encode("x"), 5)
    assert ends["broken"].items[-1] == Failed("generation failed: RuntimeError: device lost")
    assert list(ends["after"].finished.ids) == alone(engine, engine.encode("z"), 5)
    with pytest.raises(QueueFull, match="shutting down"):
        batcher.submit(Request((1, 2), 3), Events())


def submit(batcher, request, events):
    """Submit ``request``, its events to ``events``; an Event set at its end."""
    done = threading.Event()

    def on_event(event):
        events(event)
        if isinstance(event, (Finished, Failed)):
            done.set()

    batcher.submit(request, on_event)
    return done


def test_closing_the_batcher_ends_the_requests_in_flight_and_stops_the_clients(engine):
    """close() (as a signal handler does) while a request decodes: it gets a Failed end, serve_while calls ``stop``
    and waits for the clients' thread; an error of the clients is raised in the serving thread."""
    batcher = engine.batcher(BatchOptions(max_batch=2, max_seq_length=64))
    stopped, events, decoding = threading.Event(), Events(), threading.Event()
    real_decode = batcher.steps.decode

    def decode(*args):
        decoding.set()
        real_decode(*args)

    batcher.steps = dataclasses.replace(batcher.steps, decode=decode)

    def clients():
        batcher.submit(Request(tuple(engine.encode("x")), 60, GREEDY), events)
        assert decoding.wait(60)
        batcher.close()
        assert stopped.wait(60)
        raise RuntimeError("client error")

    with pytest.raises(RuntimeError, match="client error"):
        batcher.serve_while(clients, stop=stopped.set, timeout=60)
    assert events.items[-1] == Failed("the server is shutting down") and len(events.deltas) < 60


def test_engine_generate_batches_several_prompts(engine):
    together = engine.generate(PROMPTS[:4], max_new_tokens=12, sampling=GREEDY)
    for text, completion in zip(PROMPTS[:4], together, strict=True):
        (single,) = engine.generate(text, max_new_tokens=12, sampling=GREEDY)
        assert completion.ids == single.ids and completion.text == single.text
        assert completion.finish_reason == single.finish_reason and completion.prompt_ids == single.prompt_ids
    torch.manual_seed(5)
    first = engine.generate(PROMPTS[:3], max_new_tokens=8, sampling=SAMPLED)
    torch.manual_seed(5)
    assert [c.ids for c in engine.generate(PROMPTS[:3], max_new_tokens=8, sampling=SAMPLED)] == [c.ids for c in first]


def test_speculative_engines_do_not_batch(engine):
    """A verify step keeps one accepted length for all its rows: a speculating engine refuses a batcher, and
    generates several prompts one after another, each as it would alone."""
    speculating = Engine.load(engine.checkpoint_dir, device="cpu", speculative=SpeculativeOptions(prompt_lookup=2, k=3))
    with pytest.raises(ValueError, match="speculative decoding .* takes one prompt"):
        speculating.batcher(BatchOptions(max_batch=2, max_seq_length=64))
    together = speculating.generate(PROMPTS[:2], max_new_tokens=8, sampling=GREEDY)
    assert [c.ids for c in together] == [alone(engine, engine.encode(text), 8) for text in PROMPTS[:2]]


@pytest.mark.slow
def test_compiled_steps_equal_eager(engine):
    """The decode step compiled (fullgraph, one graph per row count) gives the eager tokens."""
    torch._dynamo.reset()
    compiled = Engine.load(engine.checkpoint_dir, compile="default", device="cpu")
    requests = [Request(tuple(engine.encode(text)), 6, GREEDY) for text in PROMPTS[:3]]
    requests.append(Request(tuple(engine.encode("seeded")), 6, SAMPLED, seed=9))
    assert [f.ids for f in run_all(compiled, requests)] == [f.ids for f in run_all(engine, requests)]


def served_in_cuda_graphs_as_alone(eager, load, prompts: list[list[int]], budgets: list[int]) -> None:
    """reduce-overhead on a GPU, driven as `gpt-fast serve` drives it: compiled, warmed up and served in the main
    thread while clients submit from threads of their own, with requests joining and leaving (``prompts`` through 4
    slots); each gives the tokens the ``eager`` engine's single-stream loop gives, and no step falls back from CUDA
    graphs. ``load(compile)``: the engine in that compile mode."""
    from torch._dynamo.utils import counters

    assert threading.current_thread() is threading.main_thread()
    expected = [alone(eager, prompt, budget) for prompt, budget in zip(prompts, budgets, strict=True)]
    torch._dynamo.reset()
    counters.clear()
    batcher = load("reduce-overhead").batcher(BatchOptions(max_batch=4, max_seq_length=128))
    batcher.warm_up()
    events = [Events() for _ in prompts]

    def client(index):
        assert submit(batcher, Request(tuple(prompts[index]), budgets[index], GREEDY), events[index]).wait(600)

    def clients():
        with ThreadPoolExecutor(len(prompts)) as pool:  # more at once than slots: some wait, then join
            list(pool.map(client, range(len(prompts))))

    batcher.serve_while(clients, timeout=60)
    assert [list(sink.finished.ids) for sink in events] == expected
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_the_gpu_batches_decode_in_cuda_graphs(tmp_path):
    """The tiny shape, float32: seven prompts of the test texts."""
    path = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32, seed=3)
    load = functools.partial(Engine.load, path, device="cuda", dtype="float32")
    eager = load(compile="none")
    prompts = [eager.encode(text) for text in PROMPTS]
    served_in_cuda_graphs_as_alone(eager, lambda mode: load(compile=mode), prompts, [5, 17, 1, 9, 12, 3, 20])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_the_gpu_batches_the_7b_shape_in_cuda_graphs():
    """Two layers of the Llama-2-7B shape (each layer's code is what a step's rows share), random N(0, 0.02²)
    weights in float32, whose sums round alike enough in a one-row and a four-row step that greedy choices agree:
    six prompts of random ids and lengths through the same path."""
    shape = dataclasses.replace(get_shape("llama-2-7b"), n_layer=2)
    state = random_weights(shape, torch.float32, seed=7)
    generator = torch.Generator().manual_seed(8)
    lengths = [3, 40, 1, 17, 64, 9]
    prompts = [torch.randint(1, shape.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    options = functools.partial(EngineOptions, device="cuda", dtype="float32", kernel_tuning="heuristic")
    load = functools.partial(Engine.from_state, shape, state)
    served_in_cuda_graphs_as_alone(
        load(options(compile="none")), lambda mode: load(options(compile=mode)), prompts, [12, 5, 20, 1, 16, 9]
    )
