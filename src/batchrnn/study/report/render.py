"""The summary as report.md and report.json: what each table shows is read from the summary, never
computed here beyond formatting.
"""
import math

from batchrnn.config import Impl
from batchrnn.study.protocol import can_widen, patience_label
from batchrnn.layers import backend
from batchrnn.study.report.stats import ALPHA
from batchrnn.study.report.summary import (BUILDS_ON, DEPTH, LEFT_BLANK, NONE, UNRECORDED, Summary,
                                           column_name, setting_value, shown)

FAMILY_WISE = f"a family-wise {ALPHA:.0%} level, Holm–Bonferroni"

# The legend: every rule behind it is in docs/report.md ("How to read"), which the report links to.
LEGEND = """\
Rows: mean ± std over a setting's n seeds at its chosen settings; bold: each group's best test WER; †k: k runs
stopped at the cap or floor still improving; +k diverged: seeds with no test WER. ΔWER: first minus second, WER
points, 95% interval from a two-level bootstrap (seeds, then test utterances); *: significant after Holm."""


def markdown(summary: Summary, plots: list[str], guide: str = "docs/report.md") -> str:
    """report.md; guide: the path of docs/report.md as a link from where the report is written."""
    lines = header(summary) + ["", "## How to read", "", LEGEND,
                               f"Every column and rule: [docs/report.md]({guide}#how-to-read).", ""]
    if summary.protocol:
        lines += protocol(summary)
    lines += ["## Quality at convergence", ""]
    if summary.rows:
        lines += results_table(summary)
        lines += ["", "## Head to head", ""] + head_to_head(summary)
        if summary.lm:
            lines += ["", "## With the word language model", ""] + with_lm(summary)
        lines += ["", "## Speed of convergence", ""] + speed(summary)
    else:
        lines.append("No finished runs yet" + (" at a chosen rate." if summary.protocol else "."))
    if summary.depth and summary.rows:
        lines += ["", "## BN's effect by depth", "", "ΔWER vs `none` at the same depth, in WER points with its 95% "
                  "interval (* significant, Holm-adjusted): DS2's Table 1 design, which reported BN helping more "
                  "the deeper the network.", ""] + depth_effect(summary)
    lines += ["", "## Plots", ""] + [f"![{p.removesuffix('.png')}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def header(summary: Summary) -> list[str]:
    c = summary.counts
    runs = (f"{c['finished']} finished, {c['running']} still running"
            + (f", {c['stopped']} stopped (resume with the same command)" if c["stopped"] else "")
            + (f", {c['diverged']} diverged (the `error` in its results.json says where)" if c["diverged"] else "")
            + " (unfinished runs: in the per-epoch plots only)"
            + (f", {len(summary.unreadable)} unreadable and skipped" if summary.unreadable else ""))
    lines = [f"# Study report: {summary.study}", "", f"- Preset: {summary.preset}",
             f"- Device: {summary.devices}; torch {summary.torch}", f"- Runs: {runs}"]
    if summary.only["settings"]:
        lines.append(f"- Only the runs with {shown(summary.only['settings'])} (`--only`): {summary.only['left_out']} "
                     "other runs in the folder are in no table, plot or comparison.")
    lines.append(compute_line(summary))
    if set(summary.commits) != {UNRECORDED}:  # since results.json records it: say what code made the numbers
        lines.append("- Trained at commit " + "; ".join(f"{commit} ({n} run{'s' * (n > 1)})" for commit, n in summary.commits.items())
                     + " (results.json's `commit`; runs taken from another study keep the commit they were trained at)")
    if len(summary.machines) > 1:
        lines.append(f"- Machines: {len(summary.machines)} ({'; '.join(summary.machines)}). Runs are deterministic on "
                     "one machine only, and epoch times of different machines differ (up to 1.7x seen here), so the "
                     "time ratios mix machine and variant; `make bench` measures the variants' cost in one run.")
    if len(summary.threads) > 1:
        counts = "; ".join(f"{n} runs with {t}" for t, n in summary.threads.items())
        lines.append(f"- Torch threads: {counts}. A run's epoch time depends on its threads and on what ran beside it "
                     "(two 1-thread jobs at once each take about 1.5x a 2-thread job's epoch, experiments/threads.md), "
                     "so time ratios between runs of different thread counts mix the two; `make bench` measures the "
                     "variants' cost in one run.")
    if any(n > 1 for n in summary.ranks):
        counts = "; ".join(f"{runs} runs on {n} rank{'s' * (n > 1)}" for n, runs in summary.ranks.items())
        lines.append(f"- Data-parallel: {counts}. Peak memory is per rank (the largest rank's), not the sum over "
                     "ranks; a run's epoch time is that of all its ranks together.")
    if summary.stopped:
        lines.append(f"- Stopped (nothing written for a while, so no process owns them): {', '.join(summary.stopped)}")
    if summary.duplicates:
        lines.append(f"- Left out, the same settings and seed as another folder: {', '.join(summary.duplicates)}")
    if "cpu" in summary.devices.split(", "):
        lines.append("- The CPU-sized preset was used: a small model on a small corpus, so absolute WERs are "
                     "far above full-size DS2 numbers; compare variants with each other, not with the "
                     "literature.")
    return lines


def grown(p: dict) -> str:
    """Where seeds were added to a finished study: which lists its runs were made with."""
    lists = p["seed_lists"]  # protocol_of's
    if len(lists) < 2:
        return ""
    return (" (the runs were made with " + " and with ".join(map(str, lists))
            + ", so a row holds whichever of these seeds its variant has: its n)")


def protocol(summary: Summary) -> list[str]:
    p = summary.protocol
    augment, patience = bool(p.get("tune_spec_augment")), p.get("tune_patience", 0)
    base = tuple(p.get("schedule") or ())
    patience = patience if base else 0  # no run of stage tune read: no schedule to double
    steps = range(patience + 1) if patience else []
    rates = sorted({lr for t in summary.tuning for lr in t["grid"]} | set(p["lrs"]))  # the grid, and where it widened
    lines = ["## Protocol: each variant's learning rate" + " and SpecAugment" * augment
             + " and the schedule's patience" * bool(patience) + ", chosen on validation", "",
             f"- Grid (`protocol.lrs`): {', '.join(f'{lr:g}' for lr in p['lrs'])}; tuning seeds "
             f"(`protocol.tune_seeds`): {', '.join(map(str, p['tune_seeds']))}; seeds of the verdict "
             f"(`protocol.seeds`): {', '.join(map(str, p['seeds']))}" + grown(p) + ".",
             f"- Rule: each variant (every setting but the seed, the rate{' and SpecAugment' * augment}) keeps the "
             "rate of its grid with the "
             "lowest best validation WER, averaged over the tuning seeds (ties: the smaller rate; a diverged run "
             "loses its rate); test WER plays no part. " + (
                 f"Where that rate is the grid's lowest or highest, the variant's grid widens by one rate past that "
                 f"edge, in the grid's own ratio, up to {p['widen']} time{'s' * (p['widen'] > 1)} (`protocol.widen`). "
                 if p["widen"] and can_widen(p["lrs"]) else "")
             + ("Then SpecAugment (`protocol.tune_spec_augment`, stage augment): the tuning seeds train once more at "
                "the chosen rate with SpecAugment off, and the variant keeps off only where its mean best validation "
                "WER is lower; the rates were tuned with it on. " if augment else "")
             + (f"Then the schedule's patience (`protocol.tune_patience`, stage patience): the tuning seeds train once "
                f"more at the chosen settings with `train.plateau_wait`, `train.patience` and the cap `train.epochs` "
                f"doubled ({patience_label(base, 0)} to {patience_label(base, 1)}), and the variant keeps the more "
                f"patient schedule only where its mean best validation WER is lower; where it does, the schedule "
                f"doubles again, up to {patience} time{'s' * (patience > 1)} in all. The search is by coordinates: "
                f"{'the rate and SpecAugment were' if augment else 'the rate was'} chosen at the shorter patience "
                f"({patience_label(base, 0)}), and not again at the longer one. " if patience else "")
             + "The tables below hold each variant's runs at its chosen settings only; the tuning run there is "
             "also that seed's run of the verdict.", "",
             "Best validation WER % by learning rate (mean over the tuning seeds; ✓ chosen, … not finished, blank: "
             "outside that variant's grid)" + ("; SpecAugment off: at the chosen rate" if augment else "")
             + ("; the schedules (plateau_wait/patience, cap): at the chosen rate and SpecAugment" if patience else "")
             + ":", "",
             "| variant | " + " | ".join(f"lr {lr:g}" for lr in rates) + " | SpecAugment off | SpecAugment" * augment
             + "".join(f" | {patience_label(base, k)}" for k in steps) + " |",
             "|---|" + "---:|" * len(rates) + "---:|---|" * augment + "---:|" * len(steps)]
    edges = []
    for t in summary.tuning:
        cells = []
        if t["lr"] is not None and t["lr"] in (t["grid"][0], t["grid"][-1]) and can_widen(p["lrs"]):
            edges.append(t["label"])
        for lr in rates:
            if f"{lr:g}" not in t["by_lr"]:
                cells.append("")
                continue
            wer = t["by_lr"][f"{lr:g}"]
            cell = "…" if wer is None else "diverged" if math.isinf(wer) else f"{100 * wer:.1f}"
            cells.append(f"**{cell} ✓**" if lr == t["lr"] else cell)
        if augment:
            off = t["by_augment"]["off"]
            cell = ("" if t["lr"] is None else "…" if off is None else "diverged" if math.isinf(off)
                    else f"{100 * off:.1f}")
            cells += [f"**{cell} ✓**" if t["augment"] is False else cell,
                      {True: "on", False: "off", None: "…"}[t["augment"]]]
        for k in steps:
            wer = t["by_patience"].get(k)
            cell = ("" if k not in t["patience_grid"] else "…" if wer is None else "diverged" if math.isinf(wer)
                    else f"{100 * wer:.1f}")
            cells.append(f"**{cell} ✓**" if k == t["patience"] else cell)
        lines.append(f"| {t['label']} | " + " | ".join(cells) + " |")
    if edges:
        lines += ["", "Chosen at an edge of its grid, so a rate beyond it might do better still: "
                  + ", ".join(edges) + (". Raise `protocol.widen` to look further." if p["widen"] else
                                        ". Set `protocol.widen` to 1 or more to look past it.")]
    failed = [t for t in summary.tuning if t["lr"] is None and not t["missing"]]
    if failed:
        lines += ["", "Every rate of the grid diverged, so no seeds were trained: "
                  + ", ".join(t["label"] for t in failed)
                  + ". Add lower rates to `protocol.lrs` and run the study again."]
    pending = [t for t in summary.tuning if t["lr"] is None and t["missing"]]
    if pending:
        lines += ["", "Still tuning, so in no verdict yet (their runs are in the per-epoch plots): " + "; ".join(
            f"{t['label']} (missing or unfinished lr, seed: {', '.join(f'{lr:g}, {s}' for lr, s in t['missing'])})"
            for t in pending) + "."]
    pending = [t for t in summary.tuning if augment and t["lr"] is not None and t["augment"] is None]
    if pending:
        lines += ["", "SpecAugment still tuning, so in no verdict yet: " + "; ".join(
            f"{t['label']} (seeds {', '.join(map(str, t['augment_missing']))} with it off at lr {t['lr']:g})"
            for t in pending) + "."]
    pending = [t for t in summary.tuning if patience and t["patience_grid"] and t["patience"] is None]
    if pending:
        lines += ["", "Patience still tuning, so in no verdict yet: " + "; ".join(
            f"{t['label']} (missing or unfinished schedule, seed: "
            + ", ".join(f"{patience_label(base, k)}, {seed}" for k, seed in t["patience_missing"]) + ")"
            for t in pending) + "."]
    edge = [t["label"] for t in summary.tuning if patience and t["patience"] == patience]
    if edge:
        lines += ["", f"The most patient schedule tried ({patience_label(base, patience)}) won, so a more patient one "
                  f"might do better still: {', '.join(edge)}. Raise `protocol.tune_patience` to look further."]
    if summary.off_grid:
        lines += ["", ("Outside the search (a rate outside the grid, or a schedule that is no doubling of the tuned one)"
                       if patience else "At a rate outside the grid") + f", in no table: {', '.join(summary.off_grid)}."]
    return lines + ["", preregistered(summary.preregistered), ""]


def preregistered(r: dict) -> str:
    """Whether the verdict's seeds were fixed before its runs (summary.preregistration), in one line."""
    seeds = ", ".join(map(str, r["seeds"] or []))
    if r["held"]:
        return (f"- Seeds fixed in advance: every row of the verdict holds exactly the seeds {seeds} that the preset "
                f"`{r['preset']}` gives (`protocol.seeds`, conf/experiment/{r['preset']}.yaml), and every run of the "
                "study was made with that one list; the commits its runs were trained at are in the head.")
    why = ("no one preset writes its seeds" if r["seeds"] is None else
           f"its runs were made with the seed lists {' and '.join(map(str, r['seed_lists']))}, seeds added after "
           "results could be seen" if len(r["seed_lists"]) > 1 else
           f"the preset `{r['preset']}` writes seeds {seeds}, and these rows hold others: {', '.join(r['differ'])}"
           if r["differ"] else f"the runs were made with {r['seed_lists'][0]}, not the preset's seeds {seeds}")
    return f"- Not pre-registered: {why}. The verdict is over the seeds each row's n says."


def identity_head(summary: Summary) -> list[str]:
    """The columns that name a row: rnn, layers, bn, impl, and the other settings that vary."""
    return (["rnn"] + ["layers"] * summary.depth + ["bn", "impl"]
            + [column_name(k, summary.columns) for k in summary.columns if k != DEPTH])


def identity(summary: Summary, row: dict) -> list[str]:
    return ([row["rnn"]] + [str(row["num_layers"])] * summary.depth + [row["bn"], backend(row["bn"], row["impl"])]
            + [setting_value(k, row["settings"][k]) for k in summary.columns if k != DEPTH])


def fmt(row: dict, name: str, scale: float = 1.0, digits: int = 1) -> str:
    """row[name] as "mean ± std" (the std from row[name + "_std"] when there is one), "–" when missing."""
    mean, std = row.get(name), row.get(f"{name}_std", math.nan)
    if mean is None or math.isnan(mean):
        return "–"
    s = f"{scale * mean:,.{digits}f}"
    return s if std is None or math.isnan(std) else f"{s} ± {scale * std:,.{digits}f}"


def interval(c: dict) -> str:
    """ΔWER [95% CI] in points, * when significant after Holm."""
    s = f"{100 * c['dwer']:+.1f} [{100 * c['dwer_lo']:+.1f}, {100 * c['dwer_hi']:+.1f}]"
    return f"{s} *" if c["significant"] else s


def vs_none(row: dict) -> str:
    if row["bn"] == NONE and row["impl"] == Impl.fused.value:
        return "(baseline)"
    return "–" if math.isnan(row["dwer"]) else interval(row) + (" †" if row["dwer_capped"] else "")


def seeds_cell(row: dict, of: str = "n") -> str:
    """n (or "reached of trained"), "+k diverged" and †k (capped runs)."""
    s = f"{row['n']}" if of == "n" else f"{row['reached']} of {row['trained']}"
    s += f" (+{row['diverged']} diverged)" if row["diverged"] and of == "n" else ""
    return s + (f" †{row['capped']}" if row["capped"] else "")


def results_table(summary: Summary) -> list[str]:
    head = identity_head(summary)
    serving = summary.inference is not None
    columns = head + ["n", "test WER %", "test CER %", "best val WER %", "train loss", "epoch time s", "peak mem MB",
                      "time × none", "mem × none", *["serve × none"] * serving, "params", "ΔWER vs none [95% CI]"]
    best = {}  # the best test WER of each group, in bold: placements are compared within a group
    for row in summary.rows:
        if not math.isnan(row["test_wer"]) and row["test_wer"] < best.get(row["group"], math.inf):
            best[row["group"]] = row["test_wer"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(head) + "---:|" * (len(columns) - len(head))]
    for row in summary.rows:
        wer = fmt(row, "test_wer", 100)
        cells = identity(summary, row) + [
            seeds_cell(row),
            f"**{wer}**" if row["test_wer"] == best.get(row["group"]) else wer, fmt(row, "test_cer", 100),
            fmt(row, "best_val_wer", 100), fmt(row, "train_loss_at_best", digits=2), fmt(row, "epoch_time_s"),
            fmt(row, "peak_mem_mb", digits=0), fmt(row, "time_ratio", digits=2), fmt(row, "mem_ratio", digits=2),
            *([serve_cell(row)] if serving else []), fmt(row, "params", digits=0), vs_none(row)]
        lines.append("| " + " | ".join(cells) + " |")
    if serving:
        lines += ["", serve_note(summary.inference)]
    if summary.failed:
        lines += ["", "Every seed diverged, so in no table: " + ", ".join(summary.failed) + "."]
    if summary.drift:
        spread = "; ".join(f"{d['label']}: {d['min_s']:.1f} to {d['max_s']:.1f} s" for d in summary.drift)
        lines += ["", f"Epoch times drifted: the seeds of {len(summary.drift)} setting{'s' * (len(summary.drift) > 1)} "
                  f"did the same work on one machine at speeds up to {summary.drift[0]['ratio']:.2f}x apart "
                  f"({spread}), so its speed changed while the study ran, and the time column and its ratios mix "
                  "when a run ran with the variant's cost, in every row (seeds that all ran in one slow spell agree, "
                  "so no row is known to be clean); the cost is `make bench`'s (docs/report.md)."]
    return lines


def serve_cell(row: dict) -> str:
    """The inference bench's time ratio to none (serving.attach), "(eval)" where the variant does not fold."""
    if row["serve_ratio"] is None:
        return "–"
    return f"{row['serve_ratio']:.2f}" + (" (eval)" if row["serve_way"] == "eval" else "")


def serve_note(i: dict) -> str:
    return (f"serve × none: the time to transcribe the test set over `none`'s of the same rnn and size, from "
            f"experiments/bench_inference.py's `{i['file']}`: the folded model each variant ships, or, marked (eval), "
            "the eval-mode model of a variant that does not fold, over `none`'s in the same way. Measured at batch "
            f"{i['batch']} on {i['threads']} thread{'s' * (i['threads'] != 1)}, on {i['machine']}, {i['cpus']} CPUs, "
            f"torch {i['torch']}, onnxruntime {i['onnxruntime']}, {i['date']}. –: no bench row of that variant and "
            "size.")


def capped_note(c: dict) -> str:
    """† and which side's runs reached the cap still improving, or ""."""
    parts = [f"{name}: {c['capped'][label]} of {c['n'][label]}" for name, label in ((c["a_name"], c["a"]),
                                                                                    (c["b_name"], c["b"]))
             if c["capped"][label]]
    return f"† still improving at the cap or floor ({'; '.join(parts)})" if parts else ""


def single_seed(c: dict) -> bool:
    return min(c["n"].values()) < 2


def note(c: dict) -> str:
    """The head-to-head table's note: capped runs, and a side with one seed (no seed level in its interval)."""
    parts = [capped_note(c)] + ["one seed on a side: its interval holds the test set's variation only"] * single_seed(c)
    return "; ".join(p for p in parts if p)


def name_of(c: dict, label: str | None) -> str:
    return {c["a"]: c["a_name"], c["b"]: c["b_name"]}.get(label, "–")


def pair(c: dict) -> str:
    return f"{c['group']}: {c['a_name']} vs {c['b_name']}"


def head_to_head(summary: Summary) -> list[str]:
    if not summary.comparisons:
        return [significance(summary)]
    bn_of = {r["label"]: r["bn"] for r in summary.rows}
    made = {(bn_of[c["a"]], bn_of[c["b"]]) for c in summary.comparisons}  # the pairs compare() made, not guessed
    builds = [f"`{a}` against `{b}`" for a, b in BUILDS_ON.items() if (a, b) in made]
    pairs = ["every placement against `none`", "exact DS2 (`seqwise`) against every other placement",
             *(f"{pair} (a step loop against the fused variant it adds to)" for pair in builds)]
    lines = [f"Within each group, {', '.join(pairs[:-1])} and {pairs[-1]}. "
             "ΔWER is the first minus the second (negative: the first is better); faster: the one that "
             "reaches the group's validation threshold (next section) at least half an epoch sooner, by the means, "
             "not a test (\"unclear\": the sooner mean is a lower bound, a seed of it never reached the threshold).",
             ""] + comparisons_table(summary.comparisons)
    missing = ["", "Not compared: " + "; ".join(summary.unpaired) + "."] if summary.unpaired else []
    return lines + missing + ["", significance(summary), "", splits(summary)]


def comparisons_table(comparisons: list[dict]) -> list[str]:
    lines = ["| group | comparison | ΔWER [95% CI] | p | Holm p | significant | faster | note |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for c in comparisons:
        tested = c["p"] is not None
        lines.append("| " + " | ".join([
            c["group"], f"{c['a_name']} vs {c['b_name']}", interval(c) if tested else "–",
            f"{c['p']:.4f}" if tested else "–", f"{c['p_holm']:.4f}" if tested else "–",
            ("yes" if c["significant"] else "no") if tested else "no per-utterance outputs",
            name_of(c, c["speed_winner"]) if c["speed_winner"] else "unclear" if c["speed_censored"] else "tie",
            note(c)]) + " |")
    return lines


def significance(summary: Summary, comparisons: list[dict] | None = None, table: str = "head-to-head table") -> str:
    """The family's verdict: greedy's (the summary's comparisons), or those given (the LM's) with their table."""
    tested = [c for c in (summary.comparisons if comparisons is None else comparisons) if c["p"] is not None]
    if not tested:
        return "No paired comparison: no group holds two variants with per-utterance test outputs."
    family = f"{FAMILY_WISE} over the {len(tested)} comparisons of the {table}"
    sig = [c for c in tested if c["significant"]]
    if not sig:
        return f"No difference is significant at {family}."
    parts = [f"{pair(c)} ({100 * c['dwer']:+.1f} points, {name_of(c, c['quality_winner'])} better)"
             + (" †" if capped_note(c) else "") for c in sig]
    lone = sum(single_seed(c) for c in sig)
    return (f"Significant at {family} (marked *): {', '.join(parts)}; not significant: {len(tested) - len(sig)} "
            f"of {len(tested)}."
            + (" † a run of that comparison reached the epoch cap or floor still improving."
               if any(capped_note(c) for c in sig) else "")
            + (f" {lone} of the significant rest on one seed on a side, so their intervals leave out seed-to-seed "
               "variation: more seeds may undo them." if lone else ""))


def with_lm(summary: Summary) -> list[str]:
    """Greedy and LM decoding side by side, each run's chosen LM weight and word score, and the LM's own family."""
    lm, head = summary.lm, identity_head(summary)
    lines = ["Each run's best checkpoint decoded again: torchaudio's CTC beam search with a word language model, "
             "restricted to its lexicon (`docs/decoding.md`). Each run's LM weight and word "
             "score are chosen on its own validation WER over the grid; test is decoded at that point only. Greedy "
             "columns repeat the results table's.", "", f"- LM: {'; '.join(lm['models'])}."]
    if lm["partial"]:
        lines.append(f"- Not every seed decoded, so in no LM comparison: {'; '.join(lm['partial'])}.")
    lines += ["", "| " + " | ".join(head + ["n decoded", "greedy test WER %", "LM test WER %", "LM test CER %",
                                            "ΔWER vs none with LM [95% CI]", "LM weight / word score by seed"]) + " |",
              "|" + "---|" * len(head) + "---:|" * 5 + "---|"]
    for row in summary.rows:
        if not row.get("lm_n"):
            continue
        baseline = row["bn"] == NONE and row["impl"] == Impl.fused.value
        dwer = "(baseline)" if baseline else "–" if math.isnan(row["lm_dwer"]) else interval(
            {k: row["lm_" + k] for k in ("dwer", "dwer_lo", "dwer_hi", "significant")})
        chosen = "; ".join(f"s{c['seed']}: {c['lm_weight']:g} / {c['word_score']:g}" + " ‡" * bool(c["at_edge"])
                           for c in row["lm_chosen"])
        lines.append("| " + " | ".join(identity(summary, row) + [
            f"{row['lm_n']} of {row['n']}", fmt(row, "test_wer", 100), fmt(row, "lm_test_wer", 100),
            fmt(row, "lm_test_cer", 100), dwer, chosen]) + " |")
    edge = [f"{row['label']} s{c['seed']} ({', '.join(c['at_edge'])})" for row in summary.rows
            for c in row.get("lm_chosen", []) if c["at_edge"]]
    if edge:
        lines += ["", f"‡ {len(edge)} run{'s' * (len(edge) > 1)} chose a point on an edge of the grid, where a "
                  "wider grid might choose otherwise and decode better (`decode.widen` widens it past such an edge; a "
                  "run decoded before that, or at its limit, stays there): " + "; ".join(edge) + "."]
    lines += ["", "### Head to head with the LM", "", "The head-to-head comparisons again, on each run's LM hypotheses: a "
              "second family, Holm-corrected on its own, never mixed with greedy's.", ""]
    lines += comparisons_table(lm["comparisons"])
    if lm["unpaired"]:
        lines += ["", "Not compared: " + "; ".join(lm["unpaired"]) + "."]
    return lines + ["", significance(summary, lm["comparisons"], "LM head-to-head table")]


def splits(summary: Summary) -> str:
    """The comparisons in which one variant wins one verdict and loses the other."""
    split = [c for c in summary.comparisons if c["split"]]
    if not split:
        return ("No variant wins one verdict and loses the other (quality: a significant difference; speed: "
                "reaching the validation threshold sooner).")
    return "Wins one verdict, loses the other: " + "; ".join(
        f"{pair(c)}: {name_of(c, c['quality_winner'])} better at convergence, {name_of(c, c['speed_winner'])} "
        "faster to the threshold" + (" †" if capped_note(c) else "") for c in split) + "."


def speed(summary: Summary) -> list[str]:
    head = identity_head(summary)
    lines = ["Each group's threshold is the highest of its variants' median best validation WER (over seeds: one "
             "seed that failed to train does not loosen it for the group), so at least half of every variant's seeds "
             "reach it. Epochs and training seconds (epoch times summed; validation is not timed) until "
             "validation WER first reached it, mean ± std over the seeds, diverged ones included. A seed that never "
             "reached it counts with the epochs and seconds it trained, so its row's mean is a lower bound (≥). "
             f"The last column, the early speed: epochs until validation WER first reached {LEFT_BLANK:.0%}, where a "
             "CTC model has left its blank phase (blanks alone score 100%); descriptive, not a verdict.", "",
             "| " + " | ".join(head + ["threshold val WER %", "reached", "epochs to threshold",
                                       "training s to threshold", "epochs trained",
                                       f"epochs to {LEFT_BLANK:.0%} val WER"]) + " |",
             "|" + "---|" * len(head) + "---:|" * 6]
    for row in summary.rows:
        lines.append("| " + " | ".join(identity(summary, row) + [
            fmt(row, "threshold", 100), seeds_cell(row, "reached"), bound(row, "epochs_to"),
            bound(row, "seconds_to"), fmt(row, "epochs_trained"), bound(row, "epochs_to_words", "words_censored")])
                     + " |")
    return lines


def bound(row: dict, name: str, censored: str = "censored") -> str:
    """fmt, with ≥ before a mean that counts seeds which never reached the threshold (row[censored] of them)."""
    s = fmt(row, name)
    return f"≥ {s}" if row[censored] and s != "–" else s


def depth_effect(summary: Summary) -> list[str]:
    """ΔWER vs none per depth, a line per placement: DS2's Table 1 asks whether BN helps more when deeper."""
    depths = sorted({r["num_layers"] for r in summary.rows})
    by_depth = {}
    for row in summary.rows:
        if row["bn"] != NONE:
            by_depth.setdefault(row["depth_free"], {})[row["num_layers"]] = row
    lines = ["| variant | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---|" + "---:|" * len(depths)]
    for name, rows_at in by_depth.items():
        lines.append(f"| {name} | " + " | ".join(vs_none(rows_at[d]) if d in rows_at else "–" for d in depths) + " |")
    return lines


def compute_line(summary: Summary) -> str:
    c = summary.compute
    line = (f"- Training time: {c['hours']:.2f} h over {c['runs']} runs on {summary.devices} (the sum of their epoch "
            "times: tuning, unfinished and diverged runs included; validation, testing and start-up are not timed)")
    if summary.protocol:
        line += f", {c['verdict_hours']:.2f} h of it in the runs of the verdict"
    if c["reused_runs"]:
        line += (f"; besides, {c['reused_runs']} finished runs ({c['reused_hours']:.2f} h) were taken from another "
                 "study (`protocol.reuse_from`), not trained again")
    return line + "."


def as_json(summary: Summary, plots: list[str]) -> dict:
    """report.json: the summary less the runs themselves (they are the results.json files), strict JSON."""
    return ready({
        "sweep_dir": summary.sweep_dir, "study": summary.study, "preset": summary.preset, "devices": summary.devices,
        "machines": summary.machines, "threads": summary.threads, "ranks": summary.ranks,
        "torch": summary.torch, "columns": summary.columns, **summary.counts, "skipped": summary.unreadable,
        "stopped_runs": summary.stopped,
        "duplicates": summary.duplicates, "protocol": summary.protocol, "tuning": summary.tuning,
        "off_grid": summary.off_grid, "failed": summary.failed, "unpaired": summary.unpaired,
        "compute": summary.compute, "drift": summary.drift, "only": summary.only, "commits": summary.commits,
        "preregistered": summary.preregistered,
        # the verdict's run folders: where each final run's LM decoding (the `decode` of issue 49) is attached
        "verdict_runs": [{"label": row["label"], "seed": run["seed"], "path": run["path"]}
                         for row in summary.rows for run in row["_finished"]],
        "significance": significance(summary) if summary.rows else None,
        "splits": splits(summary) if summary.rows else None, "plots": plots,
        "rows": [public(r) for r in summary.rows], "comparisons": [public(c) for c in summary.comparisons],
        **({"lm": summary.lm | {"significance": significance(summary, summary.lm["comparisons"],
                                                             "LM head-to-head table")}} if summary.lm else {}),
        **({"inference": summary.inference} if summary.inference else {})})


def public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def ready(x):
    """NaN and infinity become null, tuples lists: report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [ready(v) for v in x]
    return x
