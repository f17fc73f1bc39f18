"""Continuous batching over the paged KV cache with few blocks: requests that give their blocks back when none is left
(preempted, then resumed by prefilling their prompt and their answer so far) and requests whose prompts start with
blocks already computed (the prefix cache) give what each gives alone, greedy, sampled with a seed or with penalties;
every block comes back when the requests end; a cache too small for one sequence is refused. The reference is the
single-stream loop of :mod:`gpt_fast.generation.decode` (greedy), else the same requests with blocks to spare."""

from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_batching import Events, submit
from tiny import LaggingReadbacks, one_torch_thread

from gpt_fast import Engine, SamplingConfig
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine import batcher as batcher_module
from gpt_fast.engine.batcher import Delta, PromptLogprobs, Request
from gpt_fast.engine.options import BatchOptions
from gpt_fast.generation.options import LogitAdjustments
from gpt_fast.generation.slots import RowPrefills
from gpt_fast.model.shapes import get_shape
from gpt_fast.serve.options import ServeOptions
from gpt_fast.util.options import OptionError

GREEDY = SamplingConfig(temperature=0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50)
BLOCK = 4  # tokens per block
LONGEST = 48  # max_seq_length: 12 blocks
PER_SEQUENCE = LONGEST // BLOCK
FREE_BYTES = 2**30  # the free memory the batcher is told of, of which kv_cache_memory takes a fraction


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)
    return Engine.load(path, device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture
def blocks_of(engine, monkeypatch):
    """``kv_cache_memory`` for a cache of that many blocks (the sink included). As GiB it would be more than 1, far
    more than the tiny model's blocks take: so a fraction of the free memory, which the batcher is told is
    :data:`FREE_BYTES`."""
    monkeypatch.setattr(batcher_module, "device_free_bytes", lambda device: FREE_BYTES)
    config = engine.model.config
    assert engine.model.tok_embeddings.weight.dtype == torch.float32
    block_bytes = 2 * config.n_layer * config.n_local_heads * BLOCK * config.head_dim * 4

    def memory(blocks: int) -> float:
        return (blocks + 0.5) * block_bytes / FREE_BYTES

    return memory


def options(memory: float | None = None, max_batch: int = 4) -> BatchOptions:
    return BatchOptions(max_batch=max_batch, max_seq_length=LONGEST, block_size=BLOCK, kv_cache_memory=memory)


def run_all(engine, requests, batch_options, lag=False):
    """Every request submitted, then served until all have ended (a bounded number of steps): their events and the
    cache's use at the end."""
    batcher = engine.batcher(batch_options)
    if lag:  # the host admits, grows and preempts requests with a step's tokens still on their way, as on a GPU
        batcher.readbacks = LaggingReadbacks(batcher.device)
    events = [Events() for _ in requests]
    for request, sink in zip(requests, events, strict=True):
        batcher.submit(request, sink)
    for _ in range(20 * sum(r.max_new_tokens + 1 for r in requests)):
        if not batcher.has_work():
            break
        batcher.step()
    assert not batcher.has_work(), "the requests did not end"
    return events, batcher.cache_usage()


def alone(engine, ids, max_new_tokens):
    return engine.generate_ids(list(ids), max_new_tokens, GREEDY, ignore_eos=True).tokens[0]


def told(sink: Events) -> list[int]:
    """The tokens a request was told of, one Delta each, which its Finished repeats."""
    tokens = [delta.token for delta in sink.deltas]
    assert list(sink.finished.ids) == tokens
    return tokens


def random_prompts(rng: random.Random, count: int, prefix: tuple[int, ...] = (), tail=(4, 16)) -> list[tuple]:
    return [(*prefix, *(rng.randrange(3, 500) for _ in range(rng.randint(*tail)))) for _ in range(count)]


def client_requests(rng: random.Random, shared: tuple[int, ...], count: int) -> list[Request]:
    """A client's greedy requests: the first begins with ``shared`` and fills at least 34 positions (9 blocks); each
    later one begins with it half the time and is shorter."""
    first = random_prompts(rng, 1, shared)[0]
    requests = [Request(first, rng.randint(22, LONGEST - len(first)), GREEDY, ignore_eos=True)]
    for _ in range(count - 1):
        (prompt,) = random_prompts(rng, 1, shared if rng.random() < 0.5 else ())
        requests.append(Request(prompt, rng.randint(4, 16), GREEDY, ignore_eos=True))
    return requests


def test_many_clients_through_few_blocks_each_get_their_own_greedy_answer(engine, blocks_of):
    """16 clients, 3 requests each, one after another, through 4 slots and a cache of one longest sequence and one
    block more. The serving starts once every client has submitted its first request, all of which begin with the
    same two blocks: the second admitted finds them computed, and two requests decoded together outgrow the cache,
    whichever they are. Later requests begin with that prefix or not."""
    rng = random.Random(11)
    shared = tuple(rng.randrange(3, 500) for _ in range(2 * BLOCK))
    clients, per_client = 16, 3
    requests = [client_requests(rng, shared, per_client) for _ in range(clients)]
    sinks = [[Events() for _ in range(per_client)] for _ in range(clients)]
    batcher = engine.batcher(options(blocks_of(PER_SEQUENCE + 2)))
    assert batcher.cache_usage().blocks == PER_SEQUENCE + 1
    first_ones_in, real_step = threading.Event(), batcher.step
    barrier = threading.Barrier(clients, action=first_ones_in.set)

    def step():
        assert first_ones_in.wait(60)
        real_step()

    batcher.step = step

    def client(index):
        for number, request in enumerate(requests[index]):
            done = submit(batcher, request, sinks[index][number])
            if number == 0:
                barrier.wait(60)
            assert done.wait(120)

    def all_clients():
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))

    batcher.serve_while(all_clients, timeout=60)
    usage = batcher.cache_usage()
    assert usage.preemptions > 0 and usage.prefix_tokens_hit >= 2 * BLOCK and usage.blocks_used == 0
    flat = [(requests[index][number], sinks[index][number]) for index in range(clients) for number in range(per_client)]
    assert batcher.tokens_generated == sum(request.max_new_tokens for request, _ in flat)
    for request, sink in flat:
        assert told(sink) == alone(engine, request.prompt_ids, request.max_new_tokens)
        assert sink.finished.finish_reason == "length" and sink.finished.prompt_tokens == len(request.prompt_ids)


@pytest.mark.parametrize("seed", [0, 3])
def test_requests_preempted_with_their_last_token_on_its_way_end_when_it_comes(engine, blocks_of, seed):
    """A step behind the host (as on a GPU), greedy requests of any budget through few blocks: one preempted while
    its last token is on its way ends when the token comes (it is not resumed), and each gives its answer alone."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, 6, (), (4, 20))
    requests = [Request(prompt, rng.randint(1, LONGEST - len(prompt)), GREEDY, ignore_eos=True) for prompt in prompts]
    sinks, usage = run_all(engine, requests, options(blocks_of(PER_SEQUENCE + 2)), lag=True)
    assert usage.preemptions > 0 and usage.blocks_used == 0
    for request, sink in zip(requests, sinks, strict=True):
        assert told(sink) == alone(engine, request.prompt_ids, request.max_new_tokens)


@pytest.mark.parametrize("lag", [False, True], ids=["in-step", "a-step-behind"])
def test_seeded_sampling_gives_the_same_tokens_when_preempted(engine, blocks_of, lag):
    rng = random.Random(5)
    shared = tuple(rng.randrange(3, 500) for _ in range(BLOCK + 1))
    prompts = random_prompts(rng, 3, shared, (2, 10)) + random_prompts(rng, 3, (), (8, 20))
    requests = [
        Request(prompt, LONGEST - len(prompt) - rng.randrange(4), SAMPLED, seed=100 + i, ignore_eos=True)
        for i, prompt in enumerate(prompts)
    ]
    ample, ample_usage = run_all(engine, requests, options())
    scarce, scarce_usage = run_all(engine, requests, options(blocks_of(PER_SEQUENCE + 2)), lag)
    assert ample_usage.preemptions == 0 and scarce_usage.preemptions > 0
    assert scarce_usage.prefix_tokens_hit > 0 and scarce_usage.blocks_used == 0
    assert [told(sink) for sink in scarce] == [told(sink) for sink in ample]


@pytest.mark.parametrize("lag", [False, True], ids=["in-step", "a-step-behind"])
def test_penalties_count_the_answer_given_before_a_preemption(engine, blocks_of, lag):
    """Greedy with frequency and presence penalties (and a repetition penalty): a request resumed after giving its
    blocks back counts its answer so far as it did before, so that its next tokens are those it gives with blocks to
    spare."""
    rng = random.Random(8)
    prompts = random_prompts(rng, 4, (), (6, 14))
    adjust = [
        LogitAdjustments(frequency_penalty=1.5, presence_penalty=0.5),
        LogitAdjustments(frequency_penalty=0.8, presence_penalty=1.0),
        LogitAdjustments(frequency_penalty=2.0, repetition_penalty=1.3),
        LogitAdjustments(presence_penalty=1.5),
    ]
    requests = [
        Request(prompt, LONGEST - len(prompt), GREEDY, ignore_eos=True, adjust=a)
        for prompt, a in zip(prompts, adjust, strict=True)
    ]
    ample, ample_usage = run_all(engine, requests, options())
    scarce, scarce_usage = run_all(engine, requests, options(blocks_of(PER_SEQUENCE + 2)), lag)
    assert ample_usage.preemptions == 0 and scarce_usage.preemptions > 0
    assert [told(sink) for sink in scarce] == [told(sink) for sink in ample]
    unpenalized = [alone(engine, r.prompt_ids, r.max_new_tokens) for r in requests]
    assert all(told(sink) != plain for sink, plain in zip(ample, unpenalized, strict=True))  # the penalties matter


def test_a_prompt_that_starts_as_an_earlier_one_reuses_its_blocks(engine):
    rng = random.Random(2)
    shared = tuple(rng.randrange(3, 500) for _ in range(3 * BLOCK))
    first = Request((*shared, 7, 8, 9, 10, 11), 6, GREEDY, ignore_eos=True)
    second = Request((*shared, 12, 13, 14), 9, GREEDY, ignore_eos=True)
    batcher = engine.batcher(options())
    sinks = [Events(), Events()]
    batcher.submit(first, sinks[0])
    batcher.run()
    before = batcher.cache_usage()
    assert (before.prefix_tokens_queried, before.prefix_tokens_hit) == (len(first.prompt_ids), 0)
    batcher.submit(second, sinks[1])
    batcher.run()
    after = batcher.cache_usage()
    assert after.prefix_tokens_queried - before.prefix_tokens_queried == len(second.prompt_ids)
    assert after.prefix_tokens_hit - before.prefix_tokens_hit == 3 * BLOCK
    assert after.preemptions == 0 and after.blocks_used == 0
    for request, sink in zip((first, second), sinks, strict=True):
        assert told(sink) == alone(engine, request.prompt_ids, request.max_new_tokens)


def test_the_peak_of_blocks_counts_a_finished_run_and_restarts_when_reset(engine):
    """``blocks_peak`` keeps the most blocks a run held at its steps after they are all released (a reading between
    steps sees none), and counts from zero after :meth:`reset_peak`: a prompt of 3 blocks and 6 tokens write 17
    positions (5 blocks), a prompt of 3 tokens and 2 more 4 positions (1 block)."""
    batcher = engine.batcher(options())
    batcher.submit(Request(tuple(range(3, 3 + 3 * BLOCK)), 6, GREEDY, ignore_eos=True), Events())
    batcher.run()
    usage = batcher.cache_usage()
    assert (usage.blocks_used, usage.blocks_peak) == (0, 5)
    batcher.reset_peak()
    assert batcher.cache_usage().blocks_peak == 0
    batcher.submit(Request((5, 6, 7), 2, GREEDY, ignore_eos=True), Events())
    batcher.run()
    assert batcher.cache_usage().blocks_peak == 1


def test_prompts_admitted_together_are_prefilled_together(engine, monkeypatch):
    """Four requests submitted before a step: the second begins with the first's blocks, so the first is prefilled
    alone and the second finds them computed; the second, third and fourth then go in one prefill of three rows.
    Every answer is its solo greedy run."""
    prefills, real = [], RowPrefills.__call__

    def spy(self, prompts):
        prefills.append([len(prompt.tokens) for prompt in prompts])
        real(self, prompts)

    monkeypatch.setattr(RowPrefills, "__call__", spy)
    rng = random.Random(4)
    shared = tuple(rng.randrange(3, 500) for _ in range(2 * BLOCK))
    prompts = [(*shared, 7, 8, 9), (*shared, 10, 11), *random_prompts(rng, 2)]
    requests = [Request(prompt, 5, GREEDY, ignore_eos=True) for prompt in prompts]
    events, usage = run_all(engine, requests, options())
    assert prefills == [[len(prompts[0])], [2, len(prompts[2]), len(prompts[3])]]
    assert usage.prefix_tokens_hit == 2 * BLOCK
    for request, sink in zip(requests, events, strict=True):
        assert told(sink) == alone(engine, request.prompt_ids, request.max_new_tokens)


def test_a_batcher_left_mid_run_leaves_no_blocks_to_the_next(engine):
    """The block table is the model's: a batcher abandoned with requests in its slots (an exception out of
    ``run``) must not hand its rows to the next batcher of the same layout, whose idle rows would write through
    them into blocks its own requests hold."""
    prompts = [tuple(range(10 + 7 * i, 30 + 7 * i)) for i in range(3)]
    left = engine.batcher(options(max_batch=3))
    for prompt in prompts:
        left.submit(Request(prompt, 20, GREEDY, ignore_eos=True), lambda event: None)
    for _ in range(6):
        left.step()
    events, usage = run_all(
        engine, [Request(p, 20, GREEDY, ignore_eos=True) for p in prompts[:2]], options(max_batch=3)
    )
    assert [told(sink) for sink in events] == [alone(engine, p, 20) for p in prompts[:2]]
    assert usage.blocks_used == 0


def test_cancelled_and_finished_requests_give_every_block_back(engine, blocks_of):
    """Requests cancelled in a slot, while waiting after a preemption and before they were ever admitted, a request
    that only scores its prompt, and requests that finish: no block stays held."""
    rng = random.Random(4)
    requests = [Request(prompt, LONGEST - len(prompt), GREEDY, ignore_eos=True) for prompt in random_prompts(rng, 6)]
    scored = Request((5, 6, 7, 8, 9, 10), 0, prompt_logprobs=2)
    batcher = engine.batcher(options(blocks_of(PER_SEQUENCE + 2), max_batch=3))
    sinks = [Events() for _ in range(len(requests) + 1)]
    jobs = [batcher.submit(request, sink) for request, sink in zip([*requests, scored], sinks, strict=True)]
    for _ in range(200):
        if batcher.cache_usage().preemptions:
            break
        batcher.step()
    running = [job for job in batcher.slots if job is not None]
    resumable = [job for job in batcher.waiting if job.ids]
    never_admitted = [job for job in batcher.waiting if not job.ids and job.request is not scored]
    assert resumable and running and never_admitted and batcher.cache_usage().blocks_used > 0
    cancelled = {id(resumable[0]), id(running[0]), id(never_admitted[-1])}
    for job in jobs:
        if id(job) in cancelled:
            batcher.cancel(job)
    batcher.run()
    assert batcher.cache_usage().blocks_used == 0 and batcher.busy == 0 and batcher.queued == 0
    for job, sink in zip(jobs, sinks, strict=True):
        if id(job) in cancelled:
            assert sink.finished.finish_reason == "cancelled"
        elif job.request is scored:
            assert isinstance(sink.items[0], PromptLogprobs) and sink.finished.ids == ()
        else:
            assert told(sink) == alone(engine, job.request.prompt_ids, job.request.max_new_tokens)


def test_the_smallest_cache_serves_the_longest_request_and_refuses_a_longer_one(engine, blocks_of):
    batcher_options = options(blocks_of(PER_SEQUENCE + 1), max_batch=2)
    longest = Request(tuple(range(10, 30)), LONGEST - 20, GREEDY, ignore_eos=True)
    short = Request((40, 41, 42, 43, 44, 45, 46, 47), 12, GREEDY, ignore_eos=True)
    sinks, usage = run_all(engine, [longest, short], batcher_options)
    assert usage.blocks == PER_SEQUENCE and usage.preemptions > 0 and usage.blocks_used == 0
    for request, sink in zip((longest, short), sinks, strict=True):
        assert told(sink) == alone(engine, request.prompt_ids, request.max_new_tokens)
    batcher = engine.batcher(batcher_options)
    with pytest.raises(ValueError, match=f"= {LONGEST + 1} exceeds the context of {LONGEST} tokens"):
        batcher.submit(Request(longest.prompt_ids, longest.max_new_tokens + 1, GREEDY), Events())


def test_a_cache_too_small_for_one_sequence_is_refused(engine, blocks_of):
    with pytest.raises(OptionError, match=f"kv_cache_memory .* one sequence of max_seq_length {LONGEST} needs") as err:
        engine.batcher(options(blocks_of(PER_SEQUENCE)))
    assert "kv_cache_memory" in err.value.options


@pytest.mark.parametrize("memory", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_kv_cache_memory_must_be_a_positive_number(memory):
    with pytest.raises(OptionError, match="^kv_cache_memory must be a number of GiB") as err:
        BatchOptions(kv_cache_memory=memory)
    assert err.value.options == ("kv_cache_memory",)


def test_the_static_cache_gives_the_same_answers_without_a_prefix_cache(engine):
    rng = random.Random(5)
    shared = tuple(rng.randrange(3, 500) for _ in range(2 * BLOCK))
    requests = [Request(p, 8, GREEDY, ignore_eos=True) for p in random_prompts(rng, 5, shared)]
    static = BatchOptions(max_batch=2, max_seq_length=LONGEST, kv_cache="static")
    events, usage = run_all(engine, requests, static)
    assert [told(sink) for sink in events] == [alone(engine, r.prompt_ids, 8) for r in requests]
    assert (usage.blocks, usage.block_size, usage.blocks_used, usage.prefix_tokens_hit) == (2, LONGEST, 0, 0)
    with pytest.raises(OptionError, match="kv_cache_memory sizes the paged cache"):
        BatchOptions(kv_cache="static", kv_cache_memory=2.0)


@pytest.mark.parametrize("kv_cache", ["paged", "static"])
@pytest.mark.parametrize("lag", [False, True])
def test_prompts_prefilled_in_chunks_give_each_its_greedy_answer(engine, blocks_of, kv_cache, lag):
    """Prompts of 5 to 40 tokens in chunks of 5 (a prompt after a cached prefix, requests preempted mid-prefill on a
    scarce paged cache), decoded beside the others: each answer is its solo greedy run."""
    rng = random.Random(6)
    shared = tuple(rng.randrange(3, 500) for _ in range(2 * BLOCK))
    prompts = random_prompts(rng, 4, shared, tail=(4, 24)) + random_prompts(rng, 4, tail=(5, 40))
    requests = [Request(p, rng.randint(2, LONGEST - len(p)), GREEDY, ignore_eos=True) for p in prompts]
    memory = blocks_of(PER_SEQUENCE + 4) if kv_cache == "paged" else None
    chunked = dataclasses.replace(options(memory), kv_cache=kv_cache, prefill_chunk=5)
    events, usage = run_all(engine, requests, chunked, lag=lag)
    assert [told(sink) for sink in events] == [alone(engine, r.prompt_ids, r.max_new_tokens) for r in requests]
    assert usage.blocks_used == 0


def test_a_long_prompt_in_chunks_lets_a_running_request_go_on(engine):
    """While a 40-token prompt goes in by chunks of 4, the request already decoding gets a token at every step;
    prefilled whole, it waits for the whole prompt (one step)."""
    running = Request(tuple(range(20, 26)), 40, GREEDY, ignore_eos=True)
    long = Request(tuple(range(100, 140)), 4, GREEDY, ignore_eos=True)

    def tokens_before_the_long_prompts_first(chunk: int | None) -> int:
        batcher = engine.batcher(dataclasses.replace(options(max_batch=2), prefill_chunk=chunk))
        order: list[str] = []
        batcher.submit(running, lambda event: order.append("running") if isinstance(event, Delta) else None)
        while order.count("running") < 2:
            batcher.step()
        batcher.submit(long, lambda event: order.append("long") if isinstance(event, Delta) else None)
        batcher.run()
        return order.index("long") - 2

    assert tokens_before_the_long_prompts_first(4) >= 9  # one per chunk but the last
    assert tokens_before_the_long_prompts_first(None) <= 2  # the steps already in flight


def test_prefill_chunk_must_be_positive():
    with pytest.raises(OptionError, match="prefill_chunk"):
        BatchOptions(prefill_chunk=0)


def test_serve_hands_every_cache_option_to_the_batcher():
    given = {"block_size": 8, "kv_cache_tokens": 256, "kv_cache": "paged", "prefill_chunk": 32}
    batch = ServeOptions(**given).batch_options(512)
    assert {name: getattr(batch, name) for name in given} == given
    assert ServeOptions(kv_cache_memory=0.5).batch_options(512).kv_cache_memory == 0.5


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"kv_cache_tokens": 0}, "kv_cache_tokens must be an integer >= 1"),
        ({"kv_cache_tokens": 64, "kv_cache_memory": 2.0}, "not both"),
        ({"kv_cache_tokens": 64, "kv_cache": "static"}, "kv_cache_tokens sizes the paged cache"),
    ],
)
def test_kv_cache_tokens_checks_itself(given, message):
    with pytest.raises(OptionError, match=message):
        BatchOptions(**given)


def test_kv_cache_tokens_sizes_the_cache_in_whole_blocks(engine):
    batcher = engine.batcher(BatchOptions(max_batch=2, max_seq_length=LONGEST, block_size=BLOCK, kv_cache_tokens=50))
    assert batcher.cache_usage().blocks == 13  # 50 tokens in blocks of 4
    with pytest.raises(OptionError, match="kv_cache_tokens 40 cannot hold one sequence of max_seq_length 48"):
        engine.batcher(BatchOptions(max_batch=2, max_seq_length=LONGEST, block_size=BLOCK, kv_cache_tokens=40))
