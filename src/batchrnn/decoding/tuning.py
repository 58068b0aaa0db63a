"""A trained model decoded with the word LM, tuned like everything else on validation: its emissions computed once per
split, every (LM weight, word score) of decode's grid decoded on validation, the lowest validation WER chosen, and
test decoded at that point only. The outcome is cached in the run's folder, keyed by what it depends on, so that a
report or a second `score` reads it in a moment.
"""
import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import torch

from batchrnn.config import DataConfig, DecodeConfig, TrainConfig
from batchrnn.data.corpus import prepare_corpus, sha256
from batchrnn.data.features import FeatureSet, collate, load_features, make_batches
from batchrnn.decoding.beam import BeamSearch, LanguageModel, check, language_model
from batchrnn.metrics import error_rates
from batchrnn.progress import progress_bar
from batchrnn.storage import write_json
from batchrnn.training.checkpoint import load_model, typed
from batchrnn.training.device import uses_bf16

CACHE = "decode-{key}.json"  # in the run's folder, beside best.pt


@torch.no_grad()
def emissions(model, fs: FeatureSet, batch_size: int, device: torch.device, bf16: bool = False) -> list[torch.Tensor]:
    """Each utterance's log-probabilities (T, classes), float32 on the CPU, in the split's order; batched as
    batchrnn.training.loop.score batches them, so they are the frames greedy decoding reads."""
    model.eval()
    out = [None] * len(fs)
    for indices in make_batches(fs.lengths, batch_size, shuffle=False, seed=0):
        x, x_lens, _, _ = (b.to(device) for b in collate(fs, indices))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits, out_lens = model(x, x_lens)  # (T, N, classes)
        log_probs = logits.float().log_softmax(-1).cpu()
        for j, (i, n) in enumerate(zip(indices, out_lens.tolist())):
            out[i] = log_probs[:n, j]
    return out


def rule(cfg: DecodeConfig, lm: LanguageModel | None = None) -> dict:
    """How this code decodes at cfg with lm, as results.json's `lm` entry records it: two entries of one rule differ
    only by their models (the beam, the grid and its widening, and the LM and lexicon where lm is given: without
    it, a check that needs no corpus)."""
    return {"beam_size": cfg.beam_size, "lm_weights": [float(a) for a in cfg.lm_weights],
            "word_scores": [float(b) for b in cfg.word_scores], "widen": cfg.widen} | (
        {"lm_sha256": lm.sha256, "lexicon_words": len(lm.words)} if lm else {})


def other_rule(entry: dict | None, today: dict) -> str | None:
    """What makes a results.json `lm` entry other than a decoding by the rule `today` (rule()), or None: a run
    decoded by it needs no decoding again, so its best.pt may go (a study's runs on a machine that is gone)."""
    if not entry:
        return "not decoded with the LM"
    differ = [f"{k} {entry.get(k)!r}, not {v!r}" for k, v in today.items() if entry.get(k) != v]
    return f"decoded by another rule ({'; '.join(differ)})" if differ else None


def grid(cfg: DecodeConfig) -> list[tuple[float, float]]:
    """(LM weight, word score) in the order ties are broken: the earlier point wins."""
    return [(float(a), float(b)) for a in cfg.lm_weights for b in cfg.word_scores]


AXES = ("lm_weight", "word_score")


def edges(best: dict, axes: tuple[list[float], list[float]]) -> list[tuple[int, str, float]]:
    """The grid's edges that the best point lies on and that can widen, as (axis, "high" or "low", the value past
    it): a step past the edge as wide as the edge's own; the LM weights never below 0, so their lowest is an edge
    only above 0, and widens to 0 at most (axis 0: LM weights, 1: word scores). An axis of one value has no step
    to take."""
    out = []
    for axis, values in enumerate(axes):
        v = sorted(set(values))
        if len(v) < 2:
            continue
        for edge, at, past in (("high", v[-1], v[-1] + (v[-1] - v[-2])), ("low", v[0], v[0] - (v[1] - v[0]))):
            if axis == 0 and edge == "low":
                if at <= 0:
                    continue
                past = max(0.0, past)
            if best[AXES[axis]] == at:
                out.append((axis, edge, round(past, 9)))
    return out


def tune(search: BeamSearch, val: tuple[list, list[str]], test: tuple[list, list[str], list[str]],
         lm_weights: list[float], word_scores: list[float], widen: int = 0, progress: bool = False) -> dict:
    """val: (emissions, references); test: (emissions, references, ids). The grid lm_weights x word_scores on
    validation, widened by one value past each edge the best point lies on (edges), at most `widen` times an edge,
    until it lies on none it may widen; then test once, at the lowest validation WER (ties: the point decoded
    first: the grid's in its order, then each widening's). `at_edge` names the edges a choice still lies on."""
    start = time.perf_counter()
    (val_e, val_refs), (test_e, test_refs, test_ids) = val, test
    axes = ([float(a) for a in lm_weights], [float(b) for b in word_scores])
    scored, widened = {}, Counter()
    todo = [(a, b) for a in axes[0] for b in axes[1]]
    bar = progress_bar(total=len(todo), desc="LM grid on val", unit="point", disable=not progress)
    while todo:
        for lm_weight, word_score in todo:
            wer, cer = error_rates(val_refs, search(val_e, lm_weight, word_score))
            scored[lm_weight, word_score] = {"lm_weight": lm_weight, "word_score": word_score, "val_wer": wer,
                                             "val_cer": cer}
            bar.update()
        best = min(scored.values(), key=lambda p: p["val_wer"])  # min keeps the first of equals
        for axis, edge, past in edges(best, axes):
            if widened[axis, edge] < widen:
                widened[axis, edge] += 1
                axes[axis].append(past)
        todo = [(a, b) for a in axes[0] for b in axes[1] if (a, b) not in scored]
        bar.total += len(todo)
    bar.close()
    tuned = time.perf_counter()
    hyps = search(test_e, best["lm_weight"], best["word_score"])
    wer, cer = error_rates(test_refs, hyps)
    return {"lm_weight": best["lm_weight"], "word_score": best["word_score"], "val_wer": best["val_wer"],
            "val_cer": best["val_cer"], "grid": list(scored.values()), "widen": widen,
            "widened": {f"{AXES[axis]} {edge}": n for (axis, edge), n in widened.items()},
            "at_edge": [f"{AXES[axis]} {edge}" for axis, edge, _ in edges(best, axes)],
            "test_wer": wer, "test_cer": cer,
            "test_utterances": [{"id": i, "ref": r, "hyp": h} for i, r, h in zip(test_ids, test_refs, hyps)],
            "seconds": {"val_grid": tuned - start, "test": time.perf_counter() - tuned}}


def decode_run(checkpoint: Path, cfg: DecodeConfig, data: DataConfig | None = None, device=torch.device("cpu"),
               progress: bool = False) -> dict:
    """The model of a best.pt decoded with the LM, tuned on its validation split, from the cache beside it when the
    model, the LM and lexicon, the beam, the grid and decode.widen are the same. data: the run's own unless given
    (data.root, data.lm_text). Returns results.json's `lm` entry: the LM's name, the chosen point, the grid's
    validation WERs, test WER and CER and each test utterance's hypothesis."""
    check(cfg)
    checkpoint = Path(checkpoint)
    model, info = load_model(checkpoint, device)
    data = data or typed(DataConfig, info["config"]["data"])
    corpus = prepare_corpus(data)
    lm = language_model(cfg, data, corpus)
    points = grid(cfg)
    sets = {s: load_features(corpus, s, data) for s in ("val", "test")}
    key = hashlib.sha256(json.dumps({"model": sha256(checkpoint), "lm": lm.key(), "beam": cfg.beam_size,
                                     "grid": points, "widen": cfg.widen, "val": sets["val"].ids,
                                     "test": sets["test"].ids}).encode())
    cache = checkpoint.parent / CACHE.format(key=key.hexdigest()[:16])
    if cache.is_file():
        try:
            return json.loads(cache.read_text())
        except ValueError:
            pass  # torn from outside (it is written atomically): decoded again
    train = typed(TrainConfig, info["config"]["train"])
    bf16 = uses_bf16(train, device)
    start = time.perf_counter()
    e = {s: emissions(model, fs, train.batch_size, device, bf16) for s, fs in sets.items()}
    seconds = time.perf_counter() - start
    search = BeamSearch(lm, cfg.beam_size)
    result = tune(search, (e["val"], sets["val"].texts), (e["test"], sets["test"].texts, sets["test"].ids),
                  cfg.lm_weights, cfg.word_scores, cfg.widen, progress)
    result = {"lm": lm.path.name, "lm_built": lm.built, **rule(cfg, lm), **result}
    result["seconds"]["emissions"] = seconds
    write_json(cache, result)
    return result
