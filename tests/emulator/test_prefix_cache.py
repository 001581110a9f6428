"""The run-based prefix cache against a block-by-block OrderedDict LRU, and the run helpers."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.emulator.reuse_model import PrefixCache
from kvscope.emulator.tokens import (
    BlockRuns,
    BlockSeq,
    block_runs,
    join_runs,
    take_runs,
)
from kvscope.emulator.workloads.model import BlockChain

BS = 4


class ReferenceLru:
    """The cache as the model first defined it: one OrderedDict entry per block."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def hit(self, ids: list[int], limit_blocks: int) -> int:
        i = 0
        while i < min(len(ids), limit_blocks) and ids[i] in self.lru:
            i += 1
        return i

    def touch(self, ids: list[int]) -> None:
        if self.capacity == 0:
            return
        for block in reversed(ids):
            if block in self.lru:
                self.lru.move_to_end(block)
            else:
                self.lru[block] = None
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
            self.evicted += 1


def _paths(draw: Any) -> list[list[int]]:
    """Block-id paths of a random prefix tree: a new path extends a prefix of an earlier one.

    New ids are handed out consecutively, as the workloads' block view does, so paths are a few
    runs; some fresh ids skip ahead so runs also break inside a path.
    """
    next_id = 1
    paths: list[list[int]] = []
    for _ in range(draw(st.integers(1, 12))):
        if paths and draw(st.booleans()):
            parent = paths[draw(st.integers(0, len(paths) - 1))]
            keep = draw(st.integers(0, len(parent)))
            path = parent[:keep]
        else:
            path = []
        for _ in range(draw(st.integers(0, 3))):
            count = draw(st.integers(0, 9))
            next_id += draw(st.sampled_from([0, 0, 5]))
            path.extend(range(next_id, next_id + count))
            next_id += count
        paths.append(path)
    return paths


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[list[int]], list[tuple[int, int, int]]]:
    paths = _paths(draw)
    ops = draw(st.lists(
        st.tuples(st.integers(0, len(paths) - 1), st.integers(-2, 40), st.integers(0, 2)),
        min_size=1, max_size=40))
    return draw(st.integers(0, 30)), paths, ops


def _scatter(block: int) -> int:
    """A bijection that breaks every run, like the servers' random chained block hashes."""
    return (block * 2654435761) % (1 << 61) + 3


# How a scenario hands its sequences to the cache: "runs" (BlockRuns, the simulator's form),
# "seq" (BlockSeq of consecutive ids), "scattered" (BlockSeq of run-breaking ids, the servers'
# form), "mixed" (BlockSeq and BlockRuns alternating in one cache, consecutive ids).
FORMS = ("runs", "seq", "scattered", "mixed")


def _as_blocks(ids: list[int], form: str, step: int) -> BlockSeq | BlockRuns:
    tokens = len(ids) * BS + 1
    if form == "runs" or (form == "mixed" and step % 2):
        return BlockRuns.from_ids(ids, tokens, BS)
    return BlockSeq(tuple(ids), tokens, (0,), BS)


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.sampled_from(FORMS))
def test_same_hits_size_and_evictions_as_a_per_block_lru(
    scenario: tuple[int, list[list[int]], list[tuple[int, int, int]]], form: str
) -> None:
    capacity, paths, ops = scenario
    if form == "scattered":
        paths = [[_scatter(block) for block in path] for path in paths]
    cache, ref = PrefixCache(capacity), ReferenceLru(capacity)
    for step, (index, cut, kind) in enumerate(ops):
        ids = paths[index]
        seq = _as_blocks(ids, form, step)
        if kind == 0:
            assert cache.longest_hit_blocks(seq) == ref.hit(ids, len(ids))
        elif kind == 1:
            limit = max(cut, 0) * BS
            assert cache.longest_hit_blocks(seq, limit) == ref.hit(ids, max(cut, 0))
        else:
            # touch(seq, n) follows slice semantics, negative n included.
            num = None if cut > 35 else cut
            cache.touch(seq, num)
            ref.touch(ids if num is None else ids[:num])
        assert len(cache) == len(ref.lru)
        assert cache.evicted_blocks == ref.evicted
    every = {block for path in paths for block in path}
    for block in every | {0, -1, max(every, default=0) + 1}:
        assert (block in cache) == (block in ref.lru)


def test_server_shaped_sequences_are_never_split_into_runs() -> None:
    """The servers' random chained hashes make one run per block: the cache must not walk them.

    A run walk over a 7.5k-block prompt took ~20 ms per lookup + two touches against ~2 ms for
    the per-block form (bench_simulator.py prints the figure); ``runs`` is a cached property,
    so computing it at all would show here.
    """
    prompt = BlockSeq.from_tokens(range(64 * BS + 3), BS)
    assert len(prompt.block_hashes) == 64 and "runs" not in vars(prompt)
    cache = PrefixCache(100)
    assert cache.longest_hit_blocks(prompt) == 0
    cache.touch(prompt)
    longer = prompt.extend(range(1000, 1000 + 2 * BS))
    assert cache.longest_hit_blocks(longer) == 64
    cache.touch(longer)
    cache.touch(longer, 10)
    assert "runs" not in vars(prompt) and "runs" not in vars(longer)
    assert len(cache) == 66 and all(block in cache for block in longer.block_hashes)


def test_a_partial_refresh_keeps_the_older_tail_first_in_line() -> None:
    cache = PrefixCache(10)
    long = BlockRuns.from_ids(range(1, 9), 8 * BS + 1, BS)  # one run of 8 blocks
    cache.touch(long)
    cache.touch(long, 3)  # blocks 1-3 refreshed; 4-8 keep their older stamps
    cache.touch(BlockRuns.from_ids(range(100, 105), 5 * BS + 1, BS))  # 3 over capacity
    assert cache.evicted_blocks == 3
    assert cache.longest_hit_blocks(long) == 5  # 6, 7, 8 went first: the oldest tail


def test_block_runs_helpers() -> None:
    assert block_runs([]) == ()
    assert block_runs([3, 4, 5, 9, 10, 2]) == ((3, 3), (9, 2), (2, 1))
    assert join_runs(((3, 3),), [(6, 2), (0, 0), (9, 1)]) == ((3, 5), (9, 1))
    assert take_runs(((3, 3), (9, 2)), 4) == ((3, 3), (9, 1))
    assert take_runs(((3, 3),), 0) == ()
    seq = BlockSeq.from_tokens(range(40), BS)
    assert BlockRuns.from_ids(seq.block_hashes, 40, BS).block_hashes == seq.block_hashes
    assert sum(count for _, count in seq.runs) == seq.num_blocks


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6)), min_size=1, max_size=8))
def test_chain_runs_equal_the_chain_ids(steps: list[tuple[int, int]]) -> None:
    from kvscope.emulator.simulator import _ChainRuns

    memo = _ChainRuns()
    chain: BlockChain | None = None
    next_id = 1
    for keep, fresh in steps:
        kept = min(keep, chain.num_blocks) if chain is not None else 0
        chain = BlockChain(chain if kept else None, kept, ((next_id, fresh),) if fresh else ())
        next_id += fresh + (keep % 2)  # sometimes skip an id: a run break
        ids = chain.ids()
        assert memo.runs(chain) == block_runs(ids)
        for tokens in (0, len(ids) * BS, len(ids) * BS + 3, max(len(ids) - 1, 0) * BS):
            seq = memo.seq(chain, tokens, BS)
            assert seq.block_hashes == tuple(ids[: tokens // BS])
            assert seq.num_blocks == len(seq.block_hashes)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(FORMS))
def test_eviction_leaves_a_refreshed_parent_for_an_older_block(form: str) -> None:
    """Evicting a leaf must not run up to its parent when another block is older than it."""
    ids = [1, 2, 3, 4]
    if form == "scattered":
        ids = [_scatter(block) for block in ids]
    a, b, c, d = ids
    cache, ref = PrefixCache(3), ReferenceLru(3)
    steps = [[a, b], [c], [a], [d, a + 7 if form == "scattered" else 9]]
    for step, path in enumerate(steps):  # stamps a:3, b:0, c:2, then two new blocks: b, c go
        cache.touch(_as_blocks(path, form, step))
        ref.touch(path)
    assert set(ref.lru) == {a, d, steps[3][1]}
    assert [block in cache for block in (a, b, c)] == [True, False, False]
    assert cache.evicted_blocks == ref.evicted == 2
