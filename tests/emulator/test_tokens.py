"""The deterministic tokenizer, chat template and chained block hashes other helpers rely on."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from kvscope.emulator.tokens import (
    BlockSeq,
    apply_chat_template,
    block_hashes,
    common_prefix_len,
    encode,
    generate_output_words,
    token_id,
)

ids = st.lists(st.integers(0, 2**31 - 1), max_size=200)


def test_one_token_per_word_and_31_bit_ids() -> None:
    tokens = encode("  hello   world\nhello ")
    assert len(tokens) == 3 and tokens[0] == tokens[2] != tokens[1]
    assert all(0 <= t < 2**31 for t in tokens)


def test_ids_are_stable_across_processes() -> None:
    code = "from kvscope.emulator.tokens import token_id; print(token_id('hello'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert int(out.stdout) == token_id("hello")


def test_chat_template_adds_two_tokens_per_message_and_a_generation_prompt() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert len(apply_chat_template(messages)) == (2 + 2) + (2 + 2) + 1
    assert len(apply_chat_template(messages, add_generation_prompt=False)) == 8
    assert len(apply_chat_template([{"role": "assistant", "content": None}])) == 3


def test_previous_prompt_plus_output_is_a_prefix_of_the_next_prompt() -> None:
    history = [{"role": "user", "content": "list the files"}]
    output = " ".join(generate_output_words(7, 12))
    turn1 = apply_chat_template(history)
    turn2 = apply_chat_template(
        [*history, {"role": "assistant", "content": output}, {"role": "user", "content": "ok"}]
    )
    seen = turn1 + encode(output)
    assert common_prefix_len(seen, turn2) == len(seen)


def test_generated_output_is_deterministic_per_seed() -> None:
    assert generate_output_words(3, 50) == generate_output_words(3, 50)
    assert generate_output_words(3, 50) != generate_output_words(4, 50)
    assert len(generate_output_words(3, 50)) == 50


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    a = block_hashes([1] * 32, 16)
    assert a[0] != a[1]  # same tokens, different parent
    assert block_hashes([2] + [1] * 31, 16)[1] != a[1]  # a change upstream changes every hash


@given(first=ids, second=ids, block_size=st.sampled_from([1, 4, 16]))
def test_incremental_extension_equals_hashing_at_once(
    first: list[int], second: list[int], block_size: int
) -> None:
    whole = BlockSeq.from_tokens(first + second, block_size)
    assert BlockSeq.from_tokens(first, block_size).extend(second) == whole
    assert whole.block_hashes == block_hashes(first + second, block_size)
    assert whole.num_tokens == len(first) + len(second)


@given(common=ids, a=ids, b=ids)
def test_common_prefix_blocks_matches_tokens(common: list[int], a: list[int], b: list[int]) -> None:
    x, y = common + a, common + b
    expected = common_prefix_len(x, y) // 16
    assert BlockSeq.from_tokens(x).common_prefix_blocks(BlockSeq.from_tokens(y)) == min(
        expected, len(x) // 16, len(y) // 16
    )
