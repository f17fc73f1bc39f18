"""The blocks of a paged KV cache, on the host: handed out to sequences, shared by reference count, and kept after
use as a prefix cache, so that a prompt that starts as an earlier one did (a shared system prompt, the earlier turns
of a chat) reuses the keys and values already computed for its full blocks.

A full block is registered under its key: the serial number of the block before it in its sequence (0 for the
first) and the block's own token ids. Serial numbers are never reused, so a key names a whole prefix's token ids
exactly: two different prefixes can never share a key (no hash to collide). Blocks no sequence holds stay
registered, least recently used first, and are taken back (unregistered) only when no free block is left.

Block 0 is the cache's sink (:class:`gpt_fast.model.cache.BlockTable`): it is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

Key = tuple[int, tuple[int, ...]]  # (the previous block's serial number, this block's token ids)


class BlockAllocator:
    """Blocks ``1 .. blocks - 1`` of ``block_size`` positions each (see the module's docstring)."""

    def __init__(self, blocks: int, block_size: int) -> None:
        assert blocks >= 2 and block_size >= 1
        self.block_size = block_size
        self.capacity = blocks - 1
        self.free: deque[int] = deque(range(1, blocks))  # held by nobody, registered nowhere
        self.refs = [0] * blocks  # sequences holding each block
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered and held by nobody, least recent first
        self.by_key: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.serial_of: dict[int, int] = {}
        self.serials = 0

    @property
    def available(self) -> int:
        """Blocks that :meth:`allocate` can hand out: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.capacity - self.available

    def allocate(self) -> int | None:
        """A block for one sequence (its reference count 1), or None when every block is held. A free block
        first; else the least recently used cached one, which leaves the prefix cache."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of.pop(block)], self.serial_of[block]
        else:
            return None
        self.refs[block] = 1
        return block

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The registered blocks that hold the longest run of ``tokens``' full blocks from the start, each now held
        once more by the caller."""
        found = self.find(tokens)
        for block in found:
            self._hold(block)
        return found

    def find(self, tokens: Sequence[int]) -> list[int]:
        """:meth:`lookup`'s blocks, not held."""
        found, serial, size = [], 0, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = self.by_key.get((serial, tuple(tokens[start : start + size])))
            if block is None:
                break
            found.append(block)
            serial = self.serial_of[block]
        return found

    def register(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Register the full blocks of a sequence whose positions ``0 ..`` are ``tokens``, held in ``blocks`` in
        order, so that :meth:`lookup` finds them. A block whose key another block already has stays unregistered
        (its twin serves the lookups)."""
        serial, size = 0, self.block_size
        for index, block in enumerate(blocks[: len(tokens) // size]):
            if block not in self.serial_of:
                key = (serial, tuple(tokens[index * size : (index + 1) * size]))
                twin = self.by_key.get(key)
                if twin is not None:
                    serial = self.serial_of[twin]
                    continue
                self.serials += 1
                self.by_key[key], self.key_of[block], self.serial_of[block] = block, key, self.serials
            serial = self.serial_of[block]

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of ``blocks`` (in its order): the ones nobody else holds become free, or cached if
        registered. Released last block first, so that a prefix's first blocks are the last to be taken back."""
        for block in reversed(blocks):
            assert self.refs[block] > 0
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.serial_of:
                    self.cached[block] = None
                else:
                    self.free.append(block)

    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1
