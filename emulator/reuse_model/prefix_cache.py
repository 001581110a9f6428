"""vLLM's prefix cache of full blocks, bounded and least-recently-used, as the nodes keep it."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvscope.emulator.tokens import Blocks, BlockSeq


class PrefixCache:
    """A bounded prefix cache of full blocks keyed by chained hash, evicting least recently used.

    Like vLLM's free-block queue, a sequence's blocks are touched tail first, so within one
    sequence the tail is evicted before its prefix and the cache stays prefix-closed.

    The LRU order is kept as *stamps*: a touch of ``n`` blocks gives block ``i`` the stamp
    ``clock + n - 1 - i`` and advances the clock by ``n``, which is exactly the order an
    OrderedDict would reach by moving the blocks to its end tail first; eviction removes the
    smallest stamps, one block at a time in that order (never in bulk beyond the overflow).
    Since a block's parent always holds a larger stamp (every touch of a block touches its
    prefix too), the smallest stamp is always a *leaf* (a cached block with no cached child).

    Two storage forms, chosen by the first sequence a cache sees (each handles both kinds of
    sequence exactly; the choice is only about speed):

    * *runs*, for :class:`BlockRuns` (the simulator's run-numbered blocks): blocks are stored by
      maximal runs of consecutive ids (``seq.runs``), keyed by the run's first id; a run's
      cached part is always a prefix of it, described by *pieces* ``[end, top]`` (offsets
      ``[previous end, end)`` carry stamps ``top - offset``), newest piece first. A touch or
      lookup costs O(runs), and a heap of run tails finds the smallest stamp.
    * *per block*, for :class:`BlockSeq` (the HTTP servers' random chained hashes, where every
      run is one block long): one flat ``hash -> stamp`` dict, refreshed in bulk by
      ``dict.update(zip(...))``; a lookup bisects the prefix (the cache is prefix-closed), and
      a heap of leaves ``(stamp, index, hashes)`` finds the smallest stamp, its parent being
      ``hashes[index - 1]``.

    Relies on chained ids (an id fixes its whole prefix), as vLLM's block hashes and the
    workloads' block ids are.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.evicted_blocks = 0
        self._size = 0
        self._clock = 0
        # None until the first sequence decides the storage form.
        self._per_block: bool | None = None
        # Runs form.
        self._runs: dict[int, list[list[int]]] = {}
        # (stamp of a run's last cached block, run key); stale entries are skipped when popped.
        self._tails: list[tuple[int, int]] = []
        # Per-block form.
        self._stamps: dict[int, int] = {}
        # (stamp of hashes[index], index, hashes); every leaf has an entry with its current
        # stamp; stale and non-leaf entries are skipped or wait their turn.
        self._leaves: list[tuple[int, int, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_hash: int) -> bool:
        if self._per_block:
            return block_hash in self._stamps
        pieces = self._runs.get(block_hash)
        if pieces is not None:
            return True
        # Inside a run: O(runs) scan (not on any hot path).
        return any(key < block_hash < key + p[-1][0] for key, p in self._runs.items())

    def _form_is_per_block(self, seq: Blocks) -> bool:
        """Whether this cache stores blocks one by one (decided once, by the first sequence)."""
        if self._per_block is None:
            self._per_block = isinstance(seq, BlockSeq)
        return self._per_block

    def longest_hit_blocks(self, seq: Blocks, max_tokens: int | None = None) -> int:
        """Leading blocks of ``seq`` cached here, within ``max_tokens`` (default num_tokens - 1)."""
        limit = seq.num_tokens - 1 if max_tokens is None else max_tokens
        n = min(seq.num_blocks, max(limit, 0) // seq.block_size)
        if self._form_is_per_block(seq):
            return self._cached_prefix(seq.block_hashes, n)
        runs = self._runs
        hit = 0
        for key, count in seq.runs:
            if hit >= n:
                break
            pieces = runs.get(key)
            if pieces is None:
                break
            cached = pieces[-1][0]
            if cached < count:
                hit += cached
                break
            hit += count
        return min(hit, n)

    def _cached_prefix(self, hashes: Sequence[int], n: int) -> int:
        """Leading blocks of ``hashes[:n]`` in the per-block dict (bisection: prefix-closed)."""
        stamps = self._stamps
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in stamps:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def touch(self, seq: Blocks, num_blocks: int | None = None) -> None:
        """Insert or refresh the first ``num_blocks`` full blocks of ``seq`` (all by default).

        O(runs touched) for run-numbered blocks, one C-level dict update per touch otherwise; a
        cache of capacity 0 (prefix caching off) costs nothing.
        """
        if self.capacity_blocks == 0:
            return
        total = seq.num_blocks
        n = total if num_blocks is None else len(range(total)[:num_blocks])
        if n <= 0:
            return
        top = self._clock + n - 1  # the stamp of block 0; it decreases along the sequence
        self._clock += n
        if self._form_is_per_block(seq):
            self._touch_blocks(seq.block_hashes, n, top)
            return
        runs, tails, push = self._runs, self._tails, heapq.heappush
        left = n
        for key, count in seq.runs:
            if left <= 0:
                break
            count = min(count, left)
            left -= count
            pieces = runs.get(key)
            if pieces is None or pieces[-1][0] <= count:
                # The whole cached part is refreshed: one piece, a new tail stamp.
                self._size += count - (pieces[-1][0] if pieces is not None else 0)
                runs[key] = [[count, top]]
                push(tails, (top - count + 1, key))
            else:
                # A prefix is refreshed; blocks past it keep their (older) stamps and tail.
                keep = 0
                while pieces[keep][0] <= count:
                    keep += 1
                pieces[:keep] = [[count, top]]
            top -= count
        if self._size > self.capacity_blocks:
            self._evict(self._size - self.capacity_blocks)
        if len(tails) > 2 * len(runs) + 1024:
            self._tails = [(p[-1][1] - p[-1][0] + 1, key) for key, p in runs.items()]
            heapq.heapify(self._tails)

    def _touch_blocks(self, hashes: tuple[int, ...], n: int, top: int) -> None:
        """Per-block touch of ``hashes[:n]``, block 0 getting stamp ``top``."""
        stamps = self._stamps
        self._size += n - self._cached_prefix(hashes, n)
        # zip stops after n blocks; an existing key keeps its dict slot and takes the new stamp.
        stamps.update(zip(hashes, range(top, top - n, -1), strict=False))
        heapq.heappush(self._leaves, (top - n + 1, n - 1, hashes))
        if self._size > self.capacity_blocks:
            self._evict_blocks(self._size - self.capacity_blocks)
        if len(self._leaves) > 2 * len(stamps) + 1024:
            # Valid entries (one per distinct block at most) include every leaf.
            self._leaves = [e for e in self._leaves if stamps.get(e[2][e[1]]) == e[0]]
            heapq.heapify(self._leaves)

    def _evict(self, overflow: int) -> None:
        """Remove the ``overflow`` blocks with the smallest stamps (least recently used)."""
        runs, tails = self._runs, self._tails
        self._size -= overflow
        self.evicted_blocks += overflow
        while overflow > 0:
            stamp, key = heapq.heappop(tails)
            pieces = runs.get(key)
            if pieces is None:
                continue
            end, top = pieces[-1]
            if top - end + 1 != stamp:
                continue  # stale: the run's tail was refreshed or evicted since
            start = pieces[-2][0] if len(pieces) > 1 else 0
            # Pieces never interleave in stamp order (a touch takes a fresh range of stamps and
            # gives each run on its path a disjoint part of it), so the whole oldest piece is
            # older than every other cached block.
            drop = min(overflow, end - start)
            overflow -= drop
            end -= drop
            if end > start:
                pieces[-1][0] = end
            else:
                pieces.pop()
                if not pieces:
                    del runs[key]
                    continue
                end, top = pieces[-1]
            heapq.heappush(tails, (top - end + 1, key))

    def _evict_blocks(self, overflow: int) -> None:
        """Per-block form of :meth:`_evict`: pop the oldest leaf, then walk up its chain."""
        stamps, leaves = self._stamps, self._leaves
        self._size -= overflow
        self.evicted_blocks += overflow
        while overflow > 0:
            stamp, index, hashes = heapq.heappop(leaves)
            if stamps.get(hashes[index]) != stamp:
                continue  # stale: refreshed or evicted since
            # The first valid entry is the global minimum (every leaf is in the heap and a
            # leaf holds the smallest stamp). After removing stamp s, a block stamped s + 1 is
            # the next minimum: follow the parent while it is, without the heap.
            while True:
                del stamps[hashes[index]]
                overflow -= 1
                if index == 0:
                    break
                index -= 1
                parent = stamps[hashes[index]]
                if overflow == 0 or parent != stamp + 1:
                    heapq.heappush(leaves, (parent, index, hashes))
                    break
                stamp = parent


__all__ = ["PrefixCache"]
