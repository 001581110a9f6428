"""A tiny random-weight Llama and a byte-level BPE tokenizer, made locally (no hub), for real
vLLM servers on CPU.

A random model is a sharp oracle for KV reuse: every logprob depends on every KV value, so KV
that does not belong to the prompt changes the output, and KV that does leaves it token-exact.
Deterministic: the same seed gives the same tokenizer and the same weights (a 2-layer model of
about 0.5 M parameters; about 5 s on one core).

Run as a script to make one: ``python tests/vllm_real/tiny_model.py DIR``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
SEED = 20261201
# Role markers are single tokens, so a chat prompt's token ids are stable from turn to turn.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the prefill decode cache block token transfer pull push reuse turn prompt history tool "
    "agent request server engine memory remote local expire hold release conversation model "
    "answer question read write file search result error retry plan step code test build run "
    "data table query index span trace metric log ledger proxy router handle offer threshold"
).split()


def corpus(seed: int = SEED, lines: int = 4000) -> list[str]:
    """Seeded text to train the tokenizer on: words, numbers and punctuation, no external data."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words) + rng.choice((".", "?", "!", ",", ":")))
    return out


def make(directory: Path, seed: int = SEED) -> Path:
    """Write the tokenizer and a random 2-layer Llama to ``directory``; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        # Larger than Llama's 0.02: the next token then depends strongly on every KV value.
        initializer_range=0.2, tie_word_embeddings=False, torch_dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm_real/tiny_model.py DIR")
    print(make(Path(sys.argv[1])))
