"""The embedded default dataset: generated text with structure a small model can learn in minutes.

A fixed vocabulary of made-up words (lowercase letters) is strung into sentences by a random
Markov chain over words (each word has a few likely successors); sentences end with ".", documents
with a newline. Bytes are the tokens. The letters make the unigram entropy high (~3 nats), while
context makes most bytes predictable: a word is fixed after its first letters and the next word
comes from a handful of choices, so a model's loss can fall far below the unigram entropy.
Everything is derived from ``seed``; every rank generates the same tokens.
"""

from __future__ import annotations

import numpy as np

from .format import TokenDataset

EOS = 256  # the byte tokenizer's end-of-document id
NUM_WORDS = 64
SUCCESSORS = 3


def _words(rng: np.random.Generator) -> list[bytes]:
    words: set[bytes] = set()
    while len(words) < NUM_WORDS:
        length = int(rng.integers(2, 8))
        words.add(bytes(rng.integers(ord("a"), ord("z") + 1, size=length).astype(np.uint8)))
    return sorted(words)


def generate_documents(num_tokens: int = 1 << 20, seed: int = 1234) -> list[bytes]:
    """Documents (bytes) totalling at least ``num_tokens`` bytes, the same for the same seed."""
    rng = np.random.default_rng(seed)
    words = _words(rng)
    successors = rng.integers(0, NUM_WORDS, size=(NUM_WORDS, SUCCESSORS)).tolist()
    cum = rng.dirichlet(np.ones(SUCCESSORS), size=NUM_WORDS).cumsum(axis=1).tolist()
    docs, total = [], 0
    while total < num_tokens:  # a batch of 256 documents per round; plain Python lists keep the chain fast
        sentences = rng.integers(2, 7, size=256).tolist()
        lengths = rng.integers(4, 13, size=sum(sentences)).tolist()
        starts = rng.integers(0, NUM_WORDS, size=len(lengths)).tolist()
        draws = iter(rng.random(sum(lengths)).tolist())
        sentence_iter = iter(zip(lengths, starts))
        for n_sentences in sentences:
            parts = []
            for _ in range(n_sentences):
                n_words, w = next(sentence_iter)
                sentence = [words[w]]
                for _ in range(n_words - 1):
                    u, c = next(draws), cum[w]
                    w = successors[w][0 if u < c[0] else 1 if u < c[1] else 2]
                    sentence.append(words[w])
                parts.append(b" ".join(sentence) + b".")
            doc = b" ".join(parts) + b"\n"
            docs.append(doc)
            total += len(doc)
            if total >= num_tokens:
                break
    return docs


def embedded_dataset(seed: int = 1234, num_tokens: int = 1 << 20, eos: bool = False) -> TokenDataset:
    """The default training data as an in-memory :class:`TokenDataset` (byte tokens, vocab 256);
    with ``eos`` every document ends with the byte tokenizer's EOS id 256 (vocab 257)."""
    docs = generate_documents(num_tokens, seed)
    ends = [b"\0"] if eos else []  # a placeholder byte where the EOS id goes
    tokens = np.frombuffer(b"".join(d + e for d in docs for e in ends or [b""]), dtype=np.uint8).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum([len(d) + len(ends) for d in docs])]).astype(np.int64)
    if eos:
        tokens[offsets[1:] - 1] = EOS
    return TokenDataset(tokens=tokens, doc_offsets=offsets, vocab_size=257 if eos else 256, tokenizer="byte",
                        source=f"<embedded seed={seed}{' eos' if eos else ''}>", eos=EOS if eos else None)
