"""Decoding with a word language model: the Kneser-Ney estimator against an independent computation, the beam
decoder on a hand-made case, the settings' errors, the tuning's cache, and greedy left as it was."""
import importlib.util
import json
import random
import shutil
from collections import defaultdict

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from batchrnn.config import DecodeConfig, to_container
from batchrnn.data.text import BLANK, INDEX, LABELS, greedy_decode
from batchrnn.data.corpus import prepare_corpus
from batchrnn.decoding.beam import BeamSearch, DecodeError, LanguageModel, check, language_model
from batchrnn.decoding.lm import BOS, EOS, FALLBACK_DISCOUNT, KneserNey, build
from batchrnn.decoding import tuning
from batchrnn.decoding.tuning import tune
from batchrnn.evaluate import main as evaluate
from batchrnn.training.identity import run_name
from batchrnn.training.loop import train
from batchrnn.storage import write_json
from batchrnn.training.rundir import BEST, RESULTS
from batchrnn.study.report import write_report
from conftest import ROOT
from test_report import result as report_result, section, table_rows, write as report_write

spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "experiments" / "bench_decode.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

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


def direct_kn(sentences: list[str], order: int = 3):
    """p(word, history) of interpolated modified Kneser-Ney written straight from Chen & Goodman's definition, with
    sets of distinct left neighbours for the continuation counts: shares nothing with the estimator but the formula."""
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

    return p


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
    model, direct = KneserNey(sentences), direct_kn(sentences)
    for h in random.Random(1).sample(histories(model), 12):
        for w in [*WORDS, EOS]:
            assert arpa_prob(table, w, h) == pytest.approx(direct(w, h), rel=1e-5), (w, h)


def test_a_tiny_text_takes_the_stated_fallback_discount():
    sentences = ["YES NO", "NO", "GO YES NO"]
    model = KneserNey(sentences)
    assert model.fallback == [1, 2, 3]
    text = model.arpa()
    assert f"took the constant discount {FALLBACK_DISCOUNT}" in text.splitlines()[2]
    table, direct = read_arpa(text), direct_kn(sentences)
    for h in histories(model):
        assert sum(arpa_prob(table, w, h) for w in [*model.vocab, EOS]) == pytest.approx(1, abs=1e-6)
        for w in [*model.vocab, EOS]:
            assert arpa_prob(table, w, h) == pytest.approx(direct(w, h), rel=1e-5)


def test_the_built_file_is_named_by_its_content(tmp_path):
    first = build(corpus(), tmp_path)
    assert build(corpus(), tmp_path) == first
    assert build(corpus(seed=1), tmp_path) != first
    assert len(list(tmp_path.iterdir())) == 2


# -----------------------------------------------------------------------------
# the beam search


def spelled(frames: list[dict[str, float]]) -> torch.Tensor:
    """Log-probabilities (T, classes): each frame's named tokens get their probability, the rest share what is left."""
    rows = []
    for frame in frames:
        row = torch.full((len(LABELS),), (1 - sum(frame.values())) / (len(LABELS) - len(frame)))
        for c, p in frame.items():
            row[INDEX[c]] = p
        rows.append(row.log())
    return torch.stack(rows)


def go_ho_e(p_p: float, p_m: float) -> torch.Tensor:
    """'GO HO?E' with P and M in doubt, blanks between letters."""
    letters = [{c: 0.9} for c in "GO HO"] + [{"P": p_p, "M": p_m}, {"E": 0.9}]
    return spelled([f for letter in letters for f in (letter, {BLANK: 0.9})])


@pytest.fixture
def home_lm(tmp_path):
    """A lexicon of three words and an LM in which HOME follows GO and HOPE never does."""
    return LanguageModel(build(["GO HOME"] * 20 + ["HOPE"] * 2 + ["GO"], tmp_path), "", ["GO", "HOME", "HOPE"],
                         built=True)


def test_the_lm_overturns_greedys_word(home_lm):
    e = go_ho_e(0.55, 0.4)
    assert greedy_decode(e[:, None], torch.tensor([e.shape[0]])) == ["GO HOPE"]
    search = BeamSearch(home_lm, beam_size=10)
    assert search([e], lm_weight=0.0, word_score=0.0) == ["GO HOPE"]  # the acoustics alone: greedy's word
    assert search([e], lm_weight=1.0, word_score=0.0) == ["GO HOME"]  # the LM's


def test_tuning_chooses_on_validation_and_decodes_test_once(home_lm):
    search = BeamSearch(home_lm, beam_size=10)
    calls = []
    counting = lambda e, a, b: calls.append((len(e), a, b)) or search(e, a, b)  # noqa: E731
    val = ([go_ho_e(0.55, 0.4)] * 2, ["GO HOME"] * 2)
    test = ([go_ho_e(0.6, 0.35)], ["GO HOPE"], ["t1"])
    out = tune(counting, val, test, [0.0, 1.0, 2.0], [0.0])
    assert (out["lm_weight"], out["word_score"]) == (1.0, 0.0)  # 1 and 2 tie at 0% WER: the earlier point
    assert [g["val_wer"] for g in out["grid"]] == [0.5, 0.0, 0.0]
    assert calls[-1] == (1, 1.0, 0.0) and all(n == 2 for n, _, _ in calls[:-1])  # test once, at the choice
    assert out["test_wer"] == 0.5 and out["test_utterances"] == [{"id": "t1", "ref": "GO HOPE", "hyp": "GO HOME"}]


@pytest.mark.parametrize("widen, chosen, widened, at_edge", [
    (0, (0.0, 2.0), {}, ["word_score high"]),
    (2, (0.0, 4.0), {"word_score high": 2}, ["word_score high"]),
    (4, (0.0, 5.0), {"word_score high": 4}, []),
])
def test_the_lm_grid_widens_past_the_edge_its_choice_lies_on(widen, chosen, widened, at_edge):
    """A scripted validation WER whose optimum, word score 5, lies past the grid's highest (2): the grid widens one
    step at a time while the choice is on that edge, at most `widen` times; the LM weight, best at 0, never goes
    below 0; test is decoded once, at the choice."""
    refs = ["ONE TWO THREE FOUR FIVE SIX SEVEN EIGHT NINE TEN"]
    words = refs[0].split()

    def search(emissions, lm_weight, word_score):  # wrong words: the distance from (0, 5)
        wrong = min(len(words), round(abs(word_score - 5.0)) + round(2 * lm_weight))
        return [" ".join(["X"] * wrong + words[wrong:])] * len(emissions)

    calls = []
    counting = lambda e, a, b: calls.append((len(e), a, b)) or search(e, a, b)  # noqa: E731
    out = tune(counting, ([None] * 2, refs * 2), ([None], refs, ["t1"]), [0.0, 0.5, 1.0], [-1.0, 0.0, 1.0, 2.0],
               widen)
    assert (out["lm_weight"], out["word_score"]) == chosen and out["widened"] == widened
    assert out["at_edge"] == at_edge
    assert sorted({g["word_score"] for g in out["grid"]}) == [-1.0, 0.0, 1.0, 2.0] + [3.0, 4.0, 5.0, 6.0][:widen]
    assert {g["lm_weight"] for g in out["grid"]} == {0.0, 0.5, 1.0}  # none below 0, none past 1: not chosen there
    assert len(out["grid"]) == 3 * (4 + widen) and calls[-1] == (1, *chosen)
    assert all(n == 2 for n, _, _ in calls[:-1])


@pytest.mark.parametrize("lm_weights, word_scores, wrong, chosen, widened", [
    # both axes past their edges at once: the LM weights up, the word scores down
    ([0.5, 1.0], [-1.0, 0.0, 1.0], lambda a, b: round(abs(b + 3)) + round(2 * abs(a - 2.5)), (2.5, -3.0),
     {"lm_weight high": 4, "word_score low": 3}),
    # the lowest LM weight above 0 is an edge, and widens to 0, not below
    ([0.5, 1.0], [0.0, 1.0], lambda a, b: round(abs(b)) + round(2 * a), (0.0, 0.0),
     {"lm_weight low": 1, "word_score low": 1}),
    # a widened point that ties with the grid's loses the tie
    ([0.0], [0.0, 1.0], lambda a, b: int(b < 1), (0.0, 1.0), {"word_score high": 1}),
])
def test_the_lm_grid_widens_each_way_and_later_points_lose_ties(lm_weights, word_scores, wrong, chosen, widened):
    refs = ["ONE TWO THREE FOUR FIVE SIX SEVEN EIGHT NINE TEN"]
    words = refs[0].split()
    search = lambda e, a, b: [" ".join(["X"] * min(10, wrong(a, b)) + words[wrong(a, b):])] * len(e)  # noqa: E731
    out = tune(search, ([None], refs), ([None], refs, ["t1"]), lm_weights, word_scores, widen=4)
    assert ((out["lm_weight"], out["word_score"]), out["widened"], out["at_edge"]) == (chosen, widened, [])
    assert min(g["lm_weight"] for g in out["grid"]) >= 0


def test_an_unreadable_lm_is_refused_when_the_decoder_loads_it(home_lm, tmp_path):
    (tmp_path / "x.arpa").write_text("not a language model\n")
    search = BeamSearch(LanguageModel(tmp_path / "x.arpa", "", home_lm.words, built=False), beam_size=10)
    with pytest.raises(DecodeError, match=r"x.arpa: KenLM cannot read it .*; give a KenLM ARPA or binary file"):
        search([go_ho_e(0.55, 0.4)], 1.0, 0.0)


@pytest.mark.parametrize("settings, message", [
    ({"lm": "lm.arpa"}, r"^decode.lm=lm.arpa: greedy decoding uses no language model; add decode.decoder=beam, or "
                        r"drop decode.lm$"),
    ({"decoder": "beam", "lm": "missing.arpa"}, r"^decode.lm=missing.arpa: no such file or directory; give a KenLM "
                                                r"ARPA or binary file, or drop decode.lm"),
    ({"decoder": "beam", "lexicon": "words.txt"}, r"^decode.lexicon=words.txt:3: 'NO-GO' has characters outside the "
                                                  r"model's alphabet \('-'\); .*: correct or delete the line$"),
    ({"decoder": "beam", "word_scores": [0.0, 1.0, 1.0]}, r"^decode.word_scores=\[0.0, 1.0, 1.0\]: a value twice; "
                                                         r"give each value once$"),
    ({"decoder": "beam", "widen": -1}, r"^decode.widen=-1: must be 0 or more \(0: the grid as given\)$"),
])
def test_settings_that_cannot_work_are_named_with_their_fix(settings, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "words.txt").write_text("YES\nNO\nNO-GO\n")
    with pytest.raises(DecodeError, match=message):
        check(OmegaConf.merge(OmegaConf.structured(DecodeConfig), settings))


# -----------------------------------------------------------------------------
# a trained run decoded both ways


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smoke_root):
    """The smoke run trained twice, greedy only and with the beam decoder set: (config, folder, results) each."""
    out = {}
    for decoder in ("greedy", "beam"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["experiment=smoke", f"data.root={smoke_root}",
                                                           f"decode.decoder={decoder}"])
        folder = tmp_path_factory.mktemp(decoder) / run_name(to_container(cfg))
        out[decoder] = cfg, folder, train(cfg, folder)
    return out


def test_greedy_results_are_the_same_with_the_beam_decoder_set(runs):
    (_, greedy_dir, greedy), (_, beam_dir, beam) = runs["greedy"], runs["beam"]
    assert greedy_dir.name == beam_dir.name  # decoding is no part of the run's identity
    timing = ("epoch_time_s", "peak_mem_mb")
    strip = lambda r: {k: v for k, v in r.items() if k not in ("config", "lm", *timing)}  # noqa: E731
    assert [{k: v for k, v in e.items() if k not in (*timing, "utt_per_s")} for e in greedy["epochs"]] == \
        [{k: v for k, v in e.items() if k not in (*timing, "utt_per_s")} for e in beam["epochs"]]
    assert strip(greedy) | {"epochs": None} == strip(beam) | {"epochs": None}
    assert "lm" not in greedy and "lm" not in json.loads((greedy_dir / RESULTS).read_text())
    lm = json.loads((beam_dir / RESULTS).read_text())["lm"]
    assert lm == beam["lm"] and len(lm["test_utterances"]) == len(beam["test_utterances"])
    axes = [{p[name] for p in lm["grid"]} for name in ("lm_weight", "word_score")]
    assert len(lm["grid"]) == len(axes[0]) * len(axes[1]) >= 28  # the default grid, and each widening's
    assert lm["lm"] == f"kn3-{lm['lm_sha256'][:16]}.arpa" and lm["lm_built"]


def test_the_hypotheses_are_cached_beside_the_model(runs, monkeypatch):
    cfg, folder, results = runs["beam"]
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("decoded again despite the cache"))
    assert tuning.decode_run(folder / BEST, cfg.decode, cfg.data) == results["lm"]
    narrower = OmegaConf.merge(cfg.decode, {"lm_weights": [0.0, 1.0], "widen": 0})  # another key: decoded again
    monkeypatch.undo()
    other = tuning.decode_run(folder / BEST, narrower, cfg.data)
    assert len(other["grid"]) == 8 and len(list(folder.glob("decode-*.json"))) == 2
    unwidened = OmegaConf.merge(cfg.decode, {"widen": 0})  # the same grid, another rule: another key
    plain = tuning.decode_run(folder / BEST, unwidened, cfg.data)
    assert len(plain["grid"]) == 28
    assert len(list(folder.glob("decode-*.json"))) == 3
    # the rule each entry records: a run decoded by today's needs its best.pt no more (finish_study.py)
    lm = language_model(cfg.decode, cfg.data, prepare_corpus(cfg.data))
    today = tuning.rule(cfg.decode, lm)
    assert tuning.other_rule(results["lm"], today) is None
    assert tuning.other_rule(plain, today) == "decoded by another rule (widen 0, not 4)"
    assert "lm_weights [0.0, 1.0], not [0.0, 0.25," in tuning.other_rule(other, today)
    assert tuning.other_rule({k: v for k, v in results["lm"].items() if k != "widen"}, today) == \
        "decoded by another rule (widen None, not 4)", "the pinned commit's entries: no widening, none recorded"
    assert tuning.other_rule(None, today) == "not decoded with the LM"


# -----------------------------------------------------------------------------
# the report's LM family


def decoded(config: dict, greedy_wrong: set, lm_wrong: set, lm_weight: float, word_score: float = 1.0) -> dict:
    """A results.json with greedy's outputs and the word LM's, each wrong in one word of the utterances given, decoded
    on the default grid before it widened (no `at_edge`: the report finds the edges from the grid)."""
    out = report_result(config, greedy_wrong, [0.5, 0.3])
    utts = [{**u, "hyp": ("X" if i in lm_wrong else "YES") + " NO GO STOP ONE"}
            for i, u in enumerate(out["test_utterances"])]
    wer = len(lm_wrong) / (5 * len(utts))
    return out | {"lm": {"lm": "kn3-0123456789abcdef.arpa", "lm_sha256": "0123456789abcdef" * 4, "lm_built": True,
                         "beam_size": 50, "lm_weight": lm_weight, "word_score": word_score,
                         "grid": [{"lm_weight": a, "word_score": b, "val_wer": 0.3}
                                  for a in DecodeConfig().lm_weights for b in DecodeConfig().word_scores],
                         "val_wer": 0.2, "test_wer": wer, "test_cer": wer / 2, "test_utterances": utts}}


def test_the_report_has_the_lm_as_a_second_family_beside_greedys(tmp_path):
    root = tmp_path / "study"
    for seed in (1, 2, 3):
        # greedy: seqwise and none wrong in as many utterances; with the LM seqwise is far better
        for bn, lm_wrong in (("none", set(range(40))), ("seqwise", set(range(5)))):
            config = {"model": {"rnn": "gru", "bn": bn, "impl": "fused"}, "seed": seed}
            report_write(root, f"{bn}-{seed}", decoded(config, set(range(30)), lm_wrong, 0.5 * seed))
        config = {"model": {"rnn": "gru", "bn": "ln", "impl": "fused"}, "seed": seed}
        ln = decoded(config, set(range(30)), set(range(5)), 1.0, word_score=2.0)  # the grid's highest word score
        report_write(root, f"ln-{seed}", ln if seed == 1 else {k: v for k, v in ln.items() if k != "lm"})
    text = write_report(root, tmp_path / "out").read_text()
    greedy, lm = section(text, "Head to head"), section(text, "With the word language model")
    assert "No difference is significant at a family-wise 5% level, Holm–Bonferroni over the 3 comparisons of the " \
           "head-to-head table." in greedy
    # ln has one seed of three decoded: in the LM table, in no LM comparison
    assert "over the 1 comparisons of the LM head-to-head table (marked *): gru: seqwise vs none (-7.0 points" in lm
    assert "gru-ln: 1 of 3 seeds decoded" in lm and "kn3-0123456789abcdef.arpa (sha256 0123456789abcdef" in lm
    rows = {r[1]: r for r in table_rows(lm.split("### Head to head")[0])}
    assert rows["none"][3:] == ["3 of 3", "6.0 ± 0.0", "8.0 ± 0.0", "4.0 ± 0.0", "(baseline)", "s1: 0.5 / 1; s2: 1 / 1; s3: 1.5 / 1"]
    assert rows["seqwise"][3:6] == ["3 of 3", "6.0 ± 0.0", "1.0 ± 0.0"] and rows["seqwise"][7].endswith("*")
    assert rows["ln"][3] == "1 of 3" and rows["ln"][8] == "s1: 1 / 2 ‡"
    assert "‡ 1 run chose a point on an edge of the grid" in lm and ": gru-ln s1 (word_score high)." in lm
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["comparisons"]) == 3 and len(report["lm"]["comparisons"]) == 1
    assert report["lm"]["comparisons"][0]["significant"] and not any(c["significant"] for c in report["comparisons"])
    assert "greedy_vs_lm.png" in report["plots"] and (tmp_path / "out" / "greedy_vs_lm.png").is_file()


def test_a_report_without_lm_results_has_no_trace_of_them(tmp_path):
    root = tmp_path / "study"
    for seed in (1, 2):
        for bn in ("none", "seqwise"):
            config = {"model": {"rnn": "gru", "bn": bn, "impl": "fused"}, "seed": seed}
            report_write(root, f"{bn}-{seed}", report_result(config, set(range(10)), [0.5, 0.3]))
    text = write_report(root, tmp_path / "out").read_text()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "language model" not in text and "lm" not in report and "greedy_vs_lm.png" not in report["plots"]
    assert not any(k.startswith("lm_") for row in report["rows"] for k in row)


def test_decode_writes_each_finished_runs_lm_and_names_the_rest(runs, tmp_path, capsys):
    """evaluate decode over a study's folder: the greedy run gains an `lm` (the widened rule's keys included) and
    keeps its greedy figures; a finished run without best.pt keeps what it had and is named; an unfinished one is
    left alone; a folder with no runs is refused."""
    _, greedy_dir, greedy = runs["greedy"]
    study = tmp_path / "study"
    shutil.copytree(greedy_dir, study / "a")
    shutil.copytree(greedy_dir, study / "b", ignore=shutil.ignore_patterns(BEST))
    shutil.copytree(greedy_dir, study / "c")
    write_json(study / "c" / RESULTS, greedy | {"status": "running"})
    shutil.copytree(greedy_dir, study / "d")
    (study / "d" / BEST).write_bytes(b"not a checkpoint")  # named with its fault; the runs after it still decode
    evaluate(["decode", str(study)])
    out = capsys.readouterr().out
    a = json.loads((study / "a" / RESULTS).read_text())
    assert {k: v for k, v in a.items() if k != "lm"} == json.loads((greedy_dir / RESULTS).read_text())
    assert a["lm"]["widen"] == DecodeConfig().widen and "at_edge" in a["lm"] and len(a["lm"]["grid"]) >= 28
    assert "lm" not in json.loads((study / "b" / RESULTS).read_text())
    assert "lm" not in json.loads((study / "c" / RESULTS).read_text())
    assert ("decoded 1 finished runs with the LM (the built 3-gram); 1 not finished (running or diverged), left "
            "alone; 2 finished without a usable best.pt, keeping the lm they had: b (missing), d (") in out
    assert f"{study / 'a'}: test WER {100 * greedy['test_wer']:.2f}% greedy, {100 * a['lm']['test_wer']:.2f}%" in out
    with pytest.raises(SystemExit) as stop:
        evaluate(["decode", str(tmp_path / "empty")])
    assert stop.value.code == 2
    assert f"error: {tmp_path / 'empty'}: no results.json under it" in capsys.readouterr().err


def test_score_and_transcribe_decode_with_the_lm(runs, smoke_root, capsys):
    cfg, folder, results = runs["beam"]
    evaluate(["score", str(folder), "--split", "test", "--decoder", "beam"])
    out = capsys.readouterr().out.splitlines()
    lm = results["lm"]
    assert f"test WER {100 * results['test_wer']:.2f}%, CER {100 * results['test_cer']:.2f}%" in out[0]
    assert (f"test WER {100 * lm['test_wer']:.2f}%, CER {100 * lm['test_cer']:.2f}% with the LM {lm['lm']}" in out[1]
            and f"LM weight {lm['lm_weight']:g}, word score {lm['word_score']:g}" in out[1])
    sphere = sorted((smoke_root / "synthetic" / "an4" / "wav" / "an4test_clstk").rglob("*.sph"))[0]
    evaluate(["transcribe", str(folder), "--decoder", "beam", str(sphere)])
    hyp = {u["id"]: u["hyp"] for u in lm["test_utterances"]}[sphere.stem]
    assert capsys.readouterr().out == f"{sphere}\t{hyp}\n"  # the tuned point, as the run decoded it


def test_the_benchmark_times_greedy_and_each_beam(runs, capsys):
    _, folder, _ = runs["beam"]
    bench.main([str(folder), "--beams", "5,20", "--threads", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r.get("decoder"), r.get("beam")) for r in lines[:3]] == [("greedy", None), ("beam", 5), ("beam", 20)]
    assert lines[0]["ratio"] == 1 and all(r["s_per_utt"] > 0 for r in lines[:3])
    assert lines[3]["points"] == 28 and lines[3]["within_budget"] == (lines[3]["tuning_s"] <= 60)
