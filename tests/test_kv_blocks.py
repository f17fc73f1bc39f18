"""The paged KV cache's block allocator against a plain model of what it must do: which sequences hold which blocks
(and whether each got a block for itself or shared it through a lookup), which prefix of tokens each registered block
ends, and when each block nobody holds was let go. Random admissions (looked up, allocated, registered, as the batcher
admits a prompt), growths, releases and lookups run over few blocks of a small alphabet, so that prompts share
prefixes, blocks of equal tokens follow different prefixes, and the prefix cache is evicted often; after each, the
allocator's counts agree with the model, and every lookup finds exactly the blocks the model says it must."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from gpt_fast.engine.kv_blocks import BlockAllocator

SIZE = 2  # tokens per block in the random runs
CAPACITY = 10  # blocks to hand out in the random runs (block 0, the sink, besides)
ALPHABET = (1, 2, 3)
BASES = ((1, 2, 3, 1), (1, 2, 3, 2, 2), (2, 1), (1, 2))  # shared beginnings of the random prompts


@dataclass
class Holding:
    """A sequence of the random runs: its tokens, its blocks in order and, for each, whether a lookup shared it."""

    tokens: list[int]
    blocks: list[int]
    shared: list[bool]


class Reference:
    """What the allocator must do, kept as plainly as possible: the holders of each block; the tokens from position 0
    to the end of each registered block; which block a lookup finds for each prefix of whole blocks (a registered
    block whose shorter prefixes are all found too: a block taken back takes every longer prefix with it); when each
    block nobody holds was let go (the least recently let go is taken back first, and never while a block is free)."""

    def __init__(self, capacity: int, size: int) -> None:
        self.size = size
        self.holders: dict[int, list[int]] = {block: [] for block in range(1, capacity + 1)}
        self.registered: dict[int, tuple[int, ...]] = {}
        self.found: dict[tuple[int, ...], int] = {}
        self.let_go: dict[int, int] = {}
        self.clock = 0

    def held(self) -> set[int]:
        return {block for block, holders in self.holders.items() if holders}

    def lookup(self, tokens: list[int]) -> list[int]:
        blocks = []
        for end in range(self.size, len(tokens) + 1, self.size):
            block = self.found.get(tuple(tokens[:end]))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def hold(self, owner: int, blocks: list[int]) -> None:
        for block in blocks:
            self.holders[block].append(owner)

    def allocated(self, owner: int, block: int) -> None:
        """``block`` was handed to ``owner`` alone: check that it could be, and take it out of the prefix cache."""
        assert block in self.holders, f"block {block} is not one of the blocks to hand out"
        assert not self.holders[block], f"block {block} handed out while {self.holders[block]} hold it"
        if block in self.registered:
            free = [b for b, holders in self.holders.items() if not holders and b not in self.registered]
            assert not free, f"cached block {block} taken back while blocks {free} are free"
            cached = [b for b in self.registered if not self.holders[b]]
            assert block == min(cached, key=self.let_go.__getitem__), "not the least recently let go block"
            self._evict(block)
        self.holders[block] = [owner]

    def _evict(self, block: int) -> None:
        prefix = self.registered.pop(block)
        if self.found.get(prefix) == block:
            for longer in [p for p in self.found if p[: len(prefix)] == prefix]:
                del self.found[longer]

    def register(self, blocks: list[int], tokens: list[int]) -> None:
        """As the allocator's docstring says: each full block under its prefix, unless already registered (then
        under that same prefix) or unless another block is found for that prefix (its twin)."""
        for index, block in enumerate(blocks[: len(tokens) // self.size]):
            prefix = tuple(tokens[: (index + 1) * self.size])
            if block in self.registered:
                assert self.registered[block] == prefix
            elif prefix not in self.found:
                self.registered[block] = prefix
                self.found[prefix] = block

    def release(self, owner: int, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.holders[block].remove(owner)
            if not self.holders[block]:
                self.clock += 1
                self.let_go[block] = self.clock


class Run:
    """One random run: the allocator, the reference, the sequences alive (in the order they were admitted)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.allocator = BlockAllocator(CAPACITY + 1, SIZE)
        self.reference = Reference(CAPACITY, SIZE)
        self.alive: dict[int, Holding] = {}
        self.owners = 0
        self.lookups_hit = self.evictions = self.refusals = 0

    def prompt(self) -> list[int]:
        rng = self.rng
        start = list(rng.choice(BASES)) if rng.random() < 0.7 else []
        tokens = start + [rng.choice(ALPHABET) for _ in range(rng.randrange(0, 4 * SIZE))]
        return tokens or [rng.choice(ALPHABET)]

    def lookup(self, owner: int, tokens: list[int]) -> list[int]:
        """The allocator's lookup, checked: each block registered with exactly that prefix, and the blocks the
        reference finds."""
        found = self.allocator.lookup(tokens)
        for index, block in enumerate(found):
            prefix = tuple(tokens[: (index + 1) * SIZE])
            assert self.reference.registered.get(block) == prefix, f"block {block} found for {prefix}"
        assert found == self.reference.lookup(tokens)
        self.reference.hold(owner, found)
        self.lookups_hit += bool(found)
        return found

    def allocate(self, owner: int) -> int | None:
        block = self.allocator.allocate()
        if block is None:
            assert len(self.reference.held()) == CAPACITY, "no block handed out while some are not held"
        else:
            self.evictions += block in self.reference.registered
            self.reference.allocated(owner, block)
        return block

    def release(self, owner: int, blocks: list[int]) -> None:
        self.allocator.release(blocks)
        self.reference.release(owner, blocks)

    def admit(self) -> None:
        """A prompt as the batcher admits one: a lookup of its first full blocks (all but the last token's, none for
        a scored prompt, or some), new blocks for the rest, all its full blocks registered."""
        tokens, owner = self.prompt(), self.owners
        self.owners += 1
        whole = (len(tokens) - 1) // SIZE * SIZE
        found = self.lookup(owner, tokens[: self.rng.choice((whole, whole, 0, self.rng.randrange(whole + 1)))])
        needed = -(-len(tokens) // SIZE) - len(found)
        if self.allocator.available < needed:
            self.refusals += 1
            self.release(owner, found)
            return
        fresh = [self.allocate(owner) for _ in range(needed)]
        blocks = [*found, *fresh]
        self.allocator.register(blocks, tokens)
        self.reference.register(blocks, tokens)
        self.alive[owner] = Holding(tokens, blocks, [True] * len(found) + [False] * needed)

    def grow(self) -> None:
        """A sequence decodes a block's worth of tokens; while no block is left, the sequence admitted last lets go
        of its blocks (the batcher's preemption), until one is had or the growing sequence is the one let go."""
        owner = self.rng.choice(list(self.alive))
        sequence = self.alive[owner]
        sequence.tokens += [self.rng.choice(ALPHABET) for _ in range(SIZE)]
        while (block := self.allocate(owner)) is None:
            victim = max(self.alive)
            self.release(victim, self.alive.pop(victim).blocks)
            if victim == owner:
                return
        sequence.blocks.append(block)
        sequence.shared.append(False)

    def finish(self) -> None:
        owner = self.rng.choice(list(self.alive))
        self.release(owner, self.alive.pop(owner).blocks)

    def probe(self) -> None:
        """A lookup of a prompt's full blocks, let go at once."""
        tokens = self.rng.choice([s.tokens for s in self.alive.values()]) if self.alive else self.prompt()
        owner = self.owners
        self.owners += 1
        self.release(owner, self.lookup(owner, tokens))

    def check(self) -> None:
        allocator, reference = self.allocator, self.reference
        assert allocator.refs[0] == 0
        for block, holders in reference.holders.items():
            assert allocator.refs[block] == len(holders), f"block {block}: {allocator.refs[block]} vs {holders}"
            owners = [h for h in holders if h in self.alive]
            assert owners == holders, f"block {block} held by {holders}, of which only {owners} are alive"
            alone = [h for h in holders if not self.alive[h].shared[self.alive[h].blocks.index(block)]]
            assert len(alone) <= 1, f"block {block} allocated to {alone}"
        assert allocator.used == len(reference.held())
        assert allocator.used + allocator.available == allocator.capacity == CAPACITY
        for sequence in self.alive.values():
            assert 0 not in sequence.blocks and len(set(sequence.blocks)) == len(sequence.blocks)
            assert len(sequence.blocks) == -(-len(sequence.tokens) // SIZE)


@pytest.mark.parametrize("seed", range(8))
def test_random_admissions_growths_and_releases_agree_with_the_reference(seed):
    run = Run(seed)
    operations = (run.admit, run.admit, run.admit, run.grow, run.grow, run.finish, run.finish, run.probe)
    for _ in range(400):
        operation = run.rng.choice(operations)
        if operation in (run.grow, run.finish) and not run.alive:
            operation = run.admit
        operation()
        run.check()
    while run.alive:
        run.finish()
        run.check()
    assert run.allocator.used == 0 and run.allocator.available == CAPACITY
    assert run.lookups_hit > 20 and run.evictions > 20 and run.refusals > 0  # the run did what it is for


def registered(allocator: BlockAllocator, tokens: list[int], found: tuple[int, ...] = ()) -> list[int]:
    """``tokens`` admitted: ``found`` (held already) and new blocks for the rest, all registered."""
    blocks = [*found, *(allocator.allocate() for _ in range(-(-len(tokens) // allocator.block_size) - len(found)))]
    allocator.register(blocks, tokens)
    return blocks


def test_the_least_recently_let_go_blocks_are_taken_back_first_a_prefixs_last_blocks_before_its_first():
    allocator = BlockAllocator(6, 2)
    first, second = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    a = registered(allocator, first)
    b = registered(allocator, second)
    assert sorted(a + b) == [1, 2, 3, 4, 5] and allocator.allocate() is None
    allocator.release(a)
    allocator.release(b)
    assert allocator.used == 0 and allocator.lookup(first) == a
    allocator.release(a)  # the lookup held them: let go again, they are now the most recently let go
    taken = [allocator.allocate() for _ in range(5)]
    assert taken == [b[1], b[0], a[2], a[1], a[0]] and allocator.allocate() is None
    allocator.release(taken)
    assert allocator.lookup(first) == allocator.lookup(second) == []


def test_a_lookup_stops_at_the_first_block_taken_back():
    allocator = BlockAllocator(5, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = registered(allocator, tokens)
    allocator.release(blocks[2:])  # the last block let go first...
    allocator.release(blocks[:1])  # ...then the first, and the middle one last
    allocator.release(blocks[1:2])
    assert allocator.allocate() == 4  # the free block before any cached one
    assert allocator.allocate() == blocks[2]
    assert allocator.lookup(tokens) == blocks[:2]
    allocator.release(blocks[:1])
    allocator.release(blocks[1:2])
    assert allocator.allocate() == blocks[0]  # the middle block stays cached, but nothing leads to it
    assert allocator.lookup(tokens) == [] and allocator.lookup(tokens[:4]) == []


def test_twins_registered_from_two_sequences_keep_the_lookups_working():
    """The same tokens prefilled by two sequences without a lookup (a scored prompt): the second's blocks stay
    unregistered and free when let go, the first's serve the lookups, and a longer prompt registered through a twin
    is found whole."""
    allocator = BlockAllocator(8, 2)
    tokens = [1, 2, 3, 4]
    first = registered(allocator, tokens)
    second = registered(allocator, tokens)
    held = allocator.lookup(tokens)
    assert held == first
    allocator.release(held)
    allocator.release(first)
    longer = [*tokens, 5, 6, 7]
    found = allocator.lookup(longer[:2])  # the batcher looks up part of a prompt only: the rest is allocated anew
    third = registered(allocator, longer, tuple(found))
    assert found == first[:1] and third[1] not in first and allocator.refs[third[1]] == 1
    allocator.release(second)
    allocator.release(third)
    assert allocator.used == 0 and allocator.available == 7
    held = allocator.lookup(longer)
    assert held == [*first, third[2]]
    allocator.release(held)
    assert sorted(allocator.free) == sorted([*second, third[1], third[3]])  # the twins and the partial block


def test_prefixes_that_differ_in_an_earlier_block_never_share_a_later_one():
    allocator = BlockAllocator(8, 2)
    shared_end = [5, 6, 7, 8]
    one, other = [1, 2, *shared_end], [1, 3, *shared_end]
    first = registered(allocator, one)
    second = registered(allocator, other)
    assert not set(first) & set(second)
    allocator.release(first)
    allocator.release(second)
    assert allocator.lookup(one) == first and allocator.lookup(other) == second
    assert allocator.lookup([2, 2, *shared_end]) == [] and allocator.lookup(shared_end) == []
    allocator.release(first + second)


def test_a_block_taken_back_and_registered_again_does_not_lead_to_its_old_prefixs_blocks():
    """The first block of [A, C] is taken back and registered for [B]: a lookup of [B, C] finds only it, though the
    old second block (C after A) is still cached: its key names the serial number of the block before it, which is
    never reused, not the block's number, which is."""
    allocator = BlockAllocator(4, 2)
    old = [1, 1, 2, 2]
    first, second = registered(allocator, old)
    allocator.release([first])
    allocator.release([second])
    blocks = [allocator.allocate(), allocator.allocate()]
    assert blocks == [3, first]
    allocator.register([first], [3, 3])
    assert allocator.lookup([3, 3, 2, 2]) == [first] and allocator.lookup(old) == []
    allocator.release([first])
    allocator.release(blocks)
    assert allocator.refs[second] == 0 and allocator.used == 0


def test_block_0_is_never_handed_out():
    allocator = BlockAllocator(4, 3)
    taken = [allocator.allocate() for _ in range(3)]
    assert sorted(taken) == [1, 2, 3] and allocator.allocate() is None
    assert (allocator.used, allocator.available, allocator.capacity) == (3, 0, 3)
