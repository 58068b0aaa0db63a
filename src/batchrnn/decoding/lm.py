"""The word language model: a 3-gram with interpolated modified Kneser-Ney smoothing (Chen & Goodman 1999),
estimated here from sentences and written as an ARPA file with backoff weights, which KenLM (inside
flashlight-text, torchaudio's CTC decoder) reads. Built from the training split's transcripts only, and named by
the sha256 of what it holds.
"""
import hashlib
import math
from collections import Counter, defaultdict
from pathlib import Path

from batchrnn.storage import atomic_write

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ORDER = 3
# Where an order's discounts are undefined (no n-gram of it seen once, twice, three or four times, as on a corpus
# of 856 short sentences can happen) or fall outside (0, k] for a count of k, every discount of that order is this
# constant: absolute discounting at 0.5, valid for any count (Ney et al. 1994 find the best D near 0.5 for small
# counts). The ARPA file's header says which orders took it.
FALLBACK_DISCOUNT = 0.5
NO_PROB = -99.0  # log10 of <s>'s probability (never predicted), as KenLM writes it
UNK_PROB = -100.0  # <unk> outside the distribution: a word outside the vocabulary is never emitted


class KneserNey:
    """Interpolated modified Kneser-Ney over sentences of space-separated words.

    Counts are KenLM's adjusted counts: raw counts at the highest order and for n-grams that start with <s>
    (nothing can precede them), otherwise continuation counts N1+(. w). Each order n has discounts D1, D2, D3+
    from its counts of counts: Y = n1 / (n1 + 2 n2), Dk = k - (k + 1) Y n_{k+1} / n_k. Then, for history h,
        p(w | h) = max(c(h w) - D(c(h w)), 0) / c(h .) + gamma(h) p(w | h minus its first word),
        gamma(h) = (D1 N1(h .) + D2 N2(h .) + D3+ N3+(h .)) / c(h .),
    and the empty history's lower distribution is uniform over the vocabulary and </s>.
    """

    def __init__(self, sentences, order: int = ORDER):
        self.order = order
        raw = Counter()
        for sentence in sentences:
            words = [BOS, *sentence.split(), EOS]
            for n in range(1, order + 1):
                raw.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        if not raw:
            raise ValueError("no sentences to estimate a language model from")
        self.vocab = sorted({g[0] for g in raw if len(g) == 1} - {BOS, EOS})
        self.counts = {n: {} for n in range(1, order + 1)}  # order -> n-gram -> adjusted count
        for gram, c in raw.items():
            if len(gram) == order or gram[0] == BOS:
                self.counts[len(gram)][gram] = c
        for gram in (g for g in raw if len(g) > 1):  # each distinct n-gram is one more word before its suffix
            suffix = gram[1:]
            self.counts[len(suffix)][suffix] = self.counts[len(suffix)].get(suffix, 0) + 1
        self.counts[1].pop((BOS,), None)  # never predicted
        self.discounts, self.fallback = {}, []
        for n in range(1, order + 1):
            self.discounts[n] = self.discount(n)
        # per history: its count total and how many continuations it has with count 1, 2 and 3 or more
        self.context = defaultdict(lambda: [0, 0, 0, 0])
        for n, grams in self.counts.items():
            for gram, c in grams.items():
                row = self.context[gram[:-1]]
                row[0] += c
                row[min(c, 3)] += 1
        self._cache = {}

    def discount(self, n: int) -> tuple[float, float, float]:
        """(D1, D2, D3+) of order n, or the stated constant where they are undefined."""
        of = Counter(min(c, 5) for c in self.counts[n].values())
        n1, n2, n3, n4 = of[1], of[2], of[3], of[4]
        if min(n1, n2, n3, n4) > 0:
            y = n1 / (n1 + 2 * n2)
            d = (1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3)
            if all(0 < dk <= k for k, dk in enumerate(d, 1)):
                return d
        self.fallback.append(n)
        return (FALLBACK_DISCOUNT,) * 3

    def gamma(self, history: tuple) -> float:
        """The interpolation weight of the lower order after history (1 where the history was never seen: all
        of its mass goes to the lower order, which is what an ARPA backoff weight of 0 in log10 says)."""
        total, *n123 = self.context.get(history, (0, 0, 0, 0))
        if total == 0:
            return 1.0
        return sum(d * k for d, k in zip(self.discounts[len(history) + 1], n123)) / total

    def prob(self, word: str, history: tuple = ()) -> float:
        """p(word | history), history at most order - 1 words."""
        key = (word, history)
        if key in self._cache:
            return self._cache[key]
        if not history:
            lower = 1 / (len(self.vocab) + 1)  # uniform over the vocabulary and </s>
        else:
            lower = self.prob(word, history[1:])
        total = self.context.get(history, (0,))[0]
        p = lower
        if total:
            c = self.counts[len(history) + 1].get((*history, word), 0)
            d = self.discounts[len(history) + 1][min(c, 3) - 1] if c else 0.0
            p = (c - d) / total + self.gamma(history) * lower
        self._cache[key] = p
        return p

    def arpa(self) -> str:
        """The model as an ARPA file: every seen n-gram with its log10 probability, and below the highest order,
        the log10 backoff weight of it as a history (interpolated KN's gamma)."""
        fallback = (f"orders {', '.join(map(str, self.fallback))} took the constant discount {FALLBACK_DISCOUNT} "
                    "(their modified Kneser-Ney discounts are undefined on this text)" if self.fallback
                    else "no order took the fallback discount")
        discounts = "; ".join(f"order {n}: " + ", ".join(f"{d:.6f}" for d in ds) for n, ds in self.discounts.items())
        lines = [f"# batchrnn.decoding.lm: {self.order}-gram, interpolated modified Kneser-Ney (Chen & Goodman)",
                 f"# discounts D1, D2, D3+ {discounts}", f"# {fallback}", "", "\\data\\"]
        grams = {n: sorted(g) for n, g in self.counts.items()}
        grams[1] = sorted([*grams[1], (BOS,), (UNK,)])
        lines += [f"ngram {n}={len(g)}" for n, g in grams.items()]
        for n, gs in grams.items():
            lines += ["", f"\\{n}-grams:"]
            for gram in gs:
                if gram == (BOS,):
                    p = NO_PROB
                elif gram == (UNK,):
                    p = UNK_PROB
                else:
                    p = math.log10(self.prob(gram[-1], gram[:-1]))
                row = f"{p:.7f}\t{' '.join(gram)}"
                if n < self.order and gram[-1] != EOS and gram != (UNK,):
                    row += f"\t{math.log10(self.gamma(gram)):.7f}"
                lines.append(row)
        return "\n".join([*lines, "", "\\end\\", ""])


def build(sentences: list[str], folder: Path) -> Path:
    """The KN 3-gram of these sentences as <folder>/kn3-<sha256 of its ARPA text, 16 digits>.arpa, written once:
    the same text gives the same file, which is how results.json and the report name it."""
    text = KneserNey(sentences).arpa()
    path = Path(folder) / f"kn3-{hashlib.sha256(text.encode()).hexdigest()[:16]}.arpa"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(text))
    return path
