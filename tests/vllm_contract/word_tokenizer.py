"""A local Hugging Face tokenizer folder that counts words as the emulator does, for offline use.

vLLM's multi-turn benchmark loads ``-m/--model`` with ``AutoTokenizer.from_pretrained`` and uses it
to generate conversations (encode a text file, decode slices of it) and to count tokens. The
emulator's tokenizer is one token per whitespace-separated word (``kvscope.emulator.tokens``), so
a WordLevel model over whitespace-split words, with an unknown token for words outside its
vocabulary, gives the benchmark the same counts the emulated servers see, and needs no hub.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

UNK_TOKEN = "[UNK]"


def corpus_words(count: int, vocabulary: int = 400, seed: int = 0) -> list[str]:
    """``count`` seeded words drawn from ``vocabulary`` made-up lowercase words (no punctuation).

    Punctuation-free words keep decode → encode an exact round trip, so the benchmark's token
    arithmetic on generated prompts holds word for word.
    """
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
                    for _ in range(vocabulary)})
    return [rng.choice(vocab) for _ in range(count)]


def build_tokenizer(directory: Path, words: Iterable[str]) -> Path:
    """Write a WordLevel tokenizer over ``words`` (plus ``[UNK]``) to ``directory``; return it.

    Files: ``tokenizer.json`` (the tokenizers model), ``tokenizer_config.json`` (names the fast
    tokenizer class, so transformers needs no model config to pick it) and a minimal
    ``config.json`` for loaders that read one anyway.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {UNK_TOKEN: 0}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Whitespace only, like the emulator's str.split(): "content:" stays one token.
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory
