"""The report's statistics: mean and std over seeds, the paired two-level bootstrap with its p-value,
Holm's correction for a family of comparisons, the smallest difference a comparison could detect, and when a
validation curve first reaches a threshold.
"""
import math
from statistics import NormalDist
from typing import NamedTuple

import jiwer
import numpy as np

# 10,000 resamples: p-values down to 2e-4 ((0 + 1) / (B + 1), doubled), enough for Holm over dozens
RESAMPLES, BOOTSTRAP_SEED = 10_000, 0
ALPHA = 0.05  # family-wise


def mean_std(values: list) -> tuple[float, float]:
    """Mean and sample std across seeds (std NaN for a single seed); NaN for no values."""
    x = np.array([v for v in values if v is not None], dtype=float)
    x = x[~np.isnan(x)]
    if not len(x):
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else math.nan


def utterance_errors(result: dict) -> dict[str, tuple[int, int]]:
    """{utterance id: (word errors, reference words)} from a run's per-utterance test outputs."""
    out = {}
    for u in result.get("test_utterances") or []:
        ref, hyp = u["ref"], u["hyp"]
        if not ref.split():  # jiwer refuses an empty reference; every hypothesis word is an insertion
            out[u["id"]] = (len(hyp.split()), 0)
            continue
        w = jiwer.process_words(ref, hyp)
        out[u["id"]] = (w.substitutions + w.deletions + w.insertions, w.hits + w.substitutions + w.deletions)
    return out


class Difference(NamedTuple):
    dwer: float  # WER of a minus WER of b (fractions), each utterance's errors averaged over seeds
    lo: float  # the 95% percentile interval
    hi: float
    p: float  # two-sided bootstrap p-value of "no difference"


def paired_bootstrap(a: list[dict], b: list[dict]) -> Difference | None:
    """a's WER minus b's and its 95% interval and p, from each seed's utterance_errors (resampled_differences).
    None when the two share no scored utterance."""
    if (drawn := resampled_differences(a, b)) is None:
        return None
    dwer, diffs = drawn
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return Difference(dwer, float(lo), float(hi), bootstrap_p(diffs))


def resampled_differences(a: list[dict], b: list[dict]) -> tuple[float, np.ndarray] | None:
    """a's WER minus b's, and its bootstrap distribution (RESAMPLES values). Each resample draws each side's
    seeds with replacement, then the test utterances, the same ones for both sides. None when the two share
    no scored utterance."""
    a, b = [e for e in a if e], [e for e in b if e]  # a run without per-utterance outputs cannot be paired
    if not a or not b:
        return None
    ids = sorted(set.intersection(*(set(e) for e in a + b)))
    if not ids:
        return None
    ea, eb = (np.array([[e[u][0] for u in ids] for e in side], dtype=float) for side in (a, b))  # (seeds, utts)
    ref = np.array([b[0][u][1] for u in ids], dtype=float)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    # Seeds first: one seed that failed to train is seed-to-seed variation, which an interval over
    # utterances alone would pass off as a real difference. With one seed per side this is a no-op.
    sa = rng.integers(0, len(ea), size=(RESAMPLES, len(ea)))
    sb = rng.integers(0, len(eb), size=(RESAMPLES, len(eb)))
    # The same resampled utterances for both systems: that pairing is what makes the test sensitive.
    idx = rng.integers(0, len(ids), size=(RESAMPLES, len(ids)))
    ma = np.take_along_axis(ea[sa].mean(1), idx, axis=1).sum(1)  # (resamples,) word errors
    mb = np.take_along_axis(eb[sb].mean(1), idx, axis=1).sum(1)
    diffs = (ma - mb) / np.maximum(ref[idx].sum(1), 1.0)
    return float((ea.mean(0).sum() - eb.mean(0).sum()) / max(ref.sum(), 1.0)), diffs


def detectable(a: list[dict], b: list[dict], tests: int, power: float = 0.8) -> float | None:
    """The smallest true |ΔWER| (a fraction) that a comparison of this many seeds and this seed and utterance
    variance would find significant with probability `power`, when Holm's correction counts `tests`
    comparisons. Normal approximation: (z(1 - ALPHA / (2 tests)) + z(power)) x the standard error, the
    standard deviation of the same two-level bootstrap as paired_bootstrap's. ALPHA / tests is Holm's first
    step, the level a comparison must meet when the family's other differences are null, so this is the
    detectable difference of a comparison that stands alone in its family. None when the two cannot be paired."""
    if (drawn := resampled_differences(a, b)) is None:
        return None
    z = NormalDist().inv_cdf
    return (z(1 - ALPHA / (2 * tests)) + z(power)) * float(drawn[1].std(ddof=1))


def bootstrap_p(diffs: np.ndarray) -> float:
    """Two-sided p-value of a zero difference from its bootstrap distribution: twice the smaller tail
    beyond 0, counted as (k + 1) / (B + 1) so that it is never 0. It is the smallest alpha at which the
    (1 - alpha) percentile interval would exclude 0, so p < 0.05 goes with the 95% interval excluding 0."""
    tail = int(min(np.sum(diffs <= 0), np.sum(diffs >= 0)))
    return min(1.0, 2 * (tail + 1) / (len(diffs) + 1))


def holm(p: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the order given: the i-th smallest of m is multiplied by
    m - i + 1, and each adjusted value is at least the one before it in that order (capped at 1)."""
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(sorted(range(len(p)), key=lambda i: p[i])):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def first_reach(epochs: list[dict], threshold: float) -> tuple[int, float] | None:
    """(epoch, training seconds up to and including it) at which validation WER first reached threshold;
    None if it never did."""
    seconds = 0.0
    for e in epochs:
        seconds += e.get("epoch_time_s") or 0.0
        if e.get("val_wer") is not None and e["val_wer"] <= threshold + 1e-12:
            return e["epoch"], seconds
    return None
