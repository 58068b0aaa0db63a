"""Decoding with a word language model: the Kneser-Ney estimator against an independent computation, the beam
decoder on a hand-made case, the settings' errors, the tuning's cache, and greedy left as it was."""
import math
import random
from collections import defaultdict

import pytest

from batchrnn.decoding.lm import BOS, EOS, FALLBACK_DISCOUNT, KneserNey, build

WORDS = ["YES", "NO", "GO", "STOP", "ONE", "TWO", "THREE", "ENTER", "RUBOUT", "ERASE", *(f"W{i}" for i in range(50))]


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Sentences with a skewed, repetitive word distribution, as AN4's: enough n-grams seen 1-4 times at every order
    for the modified discounts to be defined."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    return [" ".join(rng.choices(WORDS, weights, k=rng.randint(1, 5))) for _ in range(n)]


def read_arpa(text: str) -> dict[tuple, tuple[float, float]]:
    """n-gram -> (log10 p, log10 backoff) of an ARPA file."""
    table, order = {}, 0
    for line in text.splitlines():
        if line.startswith("\\") and line.endswith("-grams:"):
            order = int(line[1:line.index("-")])
        elif order and line.strip() and not line.startswith("\\"):
            fields = line.split("\t")
            gram = tuple(fields[1].split())
            assert len(gram) == order
            table[gram] = (float(fields[0]), float(fields[2]) if len(fields) > 2 else 0.0)
    return table


def arpa_prob(table: dict, word: str, history: tuple) -> float:
    """p(word | history) as a backoff LM reads it (what KenLM does with the file)."""
    if (*history, word) in table:
        return 10 ** table[(*history, word)][0]
    bow = 10 ** table[history][1] if history in table else 1.0
    return bow * arpa_prob(table, word, history[1:])


def direct_kn(sentences: list[str], word: str, history: tuple, order: int = 3) -> float:
    """Interpolated modified Kneser-Ney written straight from Chen & Goodman's definition, with sets of distinct
    left neighbours for the continuation counts: shares nothing with the estimator but the formula."""
    padded = [[BOS, *s.split(), EOS] for s in sentences]
    grams = defaultdict(int)
    for words in padded:
        for n in range(1, order + 1):
            for i in range(len(words) - n + 1):
                grams[tuple(words[i:i + n])] += 1
    left = defaultdict(set)
    for g in grams:
        if len(g) > 1:
            left[g[1:]].add(g[0])

    def count(g):  # the count an order uses: raw at the top and after <s>, else distinct left neighbours
        return grams.get(g, 0) if len(g) == order or g[0] == BOS else len(left.get(g, ()))

    by_order = defaultdict(dict)
    for g in grams:
        if g != (BOS,) and count(g) > 0:
            by_order[len(g)][g] = count(g)

    def discounts(n):
        nk = [sum(1 for c in by_order[n].values() if c == k) for k in (1, 2, 3, 4)]
        if 0 in nk:
            return [FALLBACK_DISCOUNT] * 3
        y = nk[0] / (nk[0] + 2 * nk[1])
        d = [k - (k + 1) * y * nk[k] / nk[k - 1] for k in (1, 2, 3)]
        return d if all(0 < dk <= k for k, dk in zip((1, 2, 3), d)) else [FALLBACK_DISCOUNT] * 3

    vocab = {g[0] for g in by_order[1]}  # the words and </s>

    def p(w, h):
        lower = 1 / len(vocab) if not h else p(w, h[1:])
        n = len(h) + 1
        following = {g: c for g, c in by_order[n].items() if g[:-1] == h}
        total = sum(following.values())
        if not total:
            return lower
        d = discounts(n)
        c = following.get((*h, w), 0)
        gamma = sum(d[min(x, 3) - 1] for x in following.values()) / total
        return (max(c - d[min(c, 3) - 1], 0) if c else 0) / total + gamma * lower

    return p(word, history)


def histories(model: KneserNey) -> list[tuple]:
    return [()] + [g for n in (1, 2) for g in model.counts[n] if g[-1] != EOS] + [(BOS,)]


def test_every_history_sums_to_one_in_the_arpa_file():
    model = KneserNey(corpus())
    assert not model.fallback  # the modified discounts themselves, not the constant
    table, outcomes = read_arpa(model.arpa()), [*model.vocab, EOS]
    for h in histories(model):
        assert sum(arpa_prob(table, w, h) for w in outcomes) == pytest.approx(1, abs=1e-6), h


def test_the_arpa_file_agrees_with_a_direct_computation():
    sentences = corpus()
    table = read_arpa(KneserNey(sentences).arpa())
    model = KneserNey(sentences)
    for h in random.Random(1).sample(histories(model), 12):
        for w in [*WORDS, EOS]:
            assert arpa_prob(table, w, h) == pytest.approx(direct_kn(sentences, w, h), rel=1e-5), (w, h)


def test_a_tiny_text_takes_the_stated_fallback_discount():
    sentences = ["YES NO", "NO", "GO YES NO"]
    model = KneserNey(sentences)
    assert model.fallback == [1, 2, 3]
    text = model.arpa()
    assert f"took the constant discount {FALLBACK_DISCOUNT}" in text.splitlines()[2]
    table = read_arpa(text)
    for h in histories(model):
        assert sum(arpa_prob(table, w, h) for w in [*model.vocab, EOS]) == pytest.approx(1, abs=1e-6)
        for w in [*model.vocab, EOS]:
            assert arpa_prob(table, w, h) == pytest.approx(direct_kn(sentences, w, h), rel=1e-5)


def test_the_built_file_is_named_by_its_content(tmp_path):
    first = build(corpus(), tmp_path)
    assert build(corpus(), tmp_path) == first
    assert build(corpus(seed=1), tmp_path) != first
    assert len(list(tmp_path.iterdir())) == 2
