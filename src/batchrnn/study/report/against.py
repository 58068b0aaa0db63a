"""One study's verdicts beside an earlier study's of the same variants (for example the converged protocol's
grid against the exponential schedule's): which conclusions held and which changed. Both are read from their
runs by the report's own summary, so each side is exactly what its report.md says.

    python -m batchrnn.report NEW_DIR --against EARLIER_DIR   (writes against.md beside report.md)
"""
import math

from batchrnn.study.report import plots
from batchrnn.study.report.render import interval, name_of
from batchrnn.study.report.summary import Summary
from batchrnn.training.identity import AUGMENT, SCHEDULE

# How a head-to-head verdict of the earlier study reads in the new one (significant: Holm-adjusted, each
# study's own family).
HELD, REVERSED, LOST, GAINED, NEITHER = "held", "reversed", "no longer significant", "newly significant", "neither"
PLOT = "against.png"


def reading(earlier: dict | None, new: dict | None) -> str:
    """What became of one comparison: both tested, significant in either, and on which side."""
    if earlier is None or new is None or earlier["p"] is None or new["p"] is None:
        return "not in both"
    if earlier["significant"] and new["significant"]:
        return HELD if (earlier["dwer"] < 0) == (new["dwer"] < 0) else REVERSED
    return LOST if earlier["significant"] else GAINED if new["significant"] else NEITHER


def verdict_rows(summary: Summary) -> dict[tuple, dict]:
    """The rows of the verdict by what they are (rnn, placement, implementation, depth), whatever rate and
    SpecAugment each study chose for them."""
    return {(r["rnn"], r["bn"], r["impl"], r["num_layers"]): r for r in summary.rows if r["role"] == "verdict" and r["n"]}


def chosen(row: dict) -> str:
    """The settings its study chose: the rate, SpecAugment and the schedule's patience where they vary by row."""
    s = row["settings"]
    augment, (wait, patience) = s.get(AUGMENT), (s.get(key) for key in SCHEDULE[:2])
    return (f"lr {row['lr']:g}" + ("" if augment is None else ", SpecAugment " + ("on" if augment else "off"))
            + ("" if patience is None else f", patience {wait}/{patience}"))


def cell(row: dict | None, name: str, scale: float = 1.0, digits: int = 1) -> str:
    value = None if row is None else row.get(name)
    return "–" if value is None or math.isnan(value) else f"{scale * value:.{digits}f}"


def tested(row: dict | None) -> str:
    """Test WER % with its seeds, and † for runs that may not have converged (report.md's mark)."""
    if row is None:
        return "–"
    capped = f" †{row['capped']}" if row["capped"] else ""
    return f"{cell(row, 'test_wer', 100)} ({row['n']}{capped})"


def variants(earlier: Summary, new: Summary) -> list[tuple[dict | None, dict | None]]:
    """(earlier row, new row) of each variant of either study's verdict, the earlier study's order first."""
    before, after = verdict_rows(earlier), verdict_rows(new)
    return [(before.get(key), after.get(key)) for key in [*before, *(k for k in after if k not in before)]]


def variants_table(earlier: Summary, new: Summary) -> list[str]:
    lines = ["| variant | earlier: settings | test WER % (n) | train loss | epochs | new: settings | test WER % (n) "
             "| train loss | epochs | change in test WER (points) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for a, b in variants(earlier, new):
        both = a is not None and b is not None
        lines.append("| " + " | ".join([
            (b or a)["variant"], chosen(a) if a else "–", tested(a), cell(a, "train_loss_at_best", digits=2),
            cell(a, "epochs_trained", digits=0), chosen(b) if b else "–", tested(b),
            cell(b, "train_loss_at_best", digits=2), cell(b, "epochs_trained", digits=0),
            f"{100 * (b['test_wer'] - a['test_wer']):+.1f}" if both else "–"]) + " |")
    return lines


def by_pair(summary: Summary) -> dict[tuple, dict]:
    """The head-to-head comparisons by what they compare (group, first placement, second), whatever the rates."""
    return {(c["group"], c["a_name"], c["b_name"]): c for c in summary.comparisons}


def comparisons_table(earlier: Summary, new: Summary) -> list[str]:
    before, after = by_pair(earlier), by_pair(new)
    lines = ["| group | comparison | earlier ΔWER [95% CI] | faster | new ΔWER [95% CI] | faster | quality verdict |",
             "|---|---|---:|---|---:|---|---|"]
    for key in [*before, *(k for k in after if k not in before)]:
        a, b = before.get(key), after.get(key)
        lines.append("| " + " | ".join([
            key[0], f"{key[1]} vs {key[2]}", quality(a), faster(a), quality(b), faster(b), reading(a, b)]) + " |")
    return lines


def quality(c: dict | None) -> str:
    return "–" if c is None or c["p"] is None else interval(c)


def faster(c: dict | None) -> str:
    if c is None:
        return "–"
    return name_of(c, c["speed_winner"]) if c["speed_winner"] else "unclear" if c["speed_censored"] else "tie"


def draw(earlier: Summary, new: Summary, out_dir) -> str | None:
    """The variants' test WER in both studies as a plot (PLOT in out_dir); its file name, None with no variant."""
    if not (pairs := variants(earlier, new)):
        return None
    plots.earlier_vs_new(pairs, out_dir / PLOT, earlier.study, new.study)
    return PLOT


def markdown(earlier: Summary, new: Summary, plot: str | None = None) -> str:
    counts = {r: sum(reading(c, verdict) == r for c, verdict in paired(earlier, new)) for r in
              (HELD, REVERSED, LOST, GAINED, NEITHER)}
    return "\n".join([
        f"# {new.study} against {earlier.study}", "",
        f"- Earlier: `{earlier.sweep_dir}` (preset {earlier.preset}); new: `{new.sweep_dir}` (preset {new.preset}).",
        "- Each variant at the settings its own study chose on validation (rate, and SpecAugment and the "
        "schedule's patience where that study tuned them), test WER the mean over its seeds. † marks runs that reached the cap or the floor while "
        "validation still improved. Train loss is at the tested epoch: a variant that trails with a higher train "
        "loss is underfit, not beaten.",
        "- The change in test WER is not a test: the two studies' runs are different runs. Significance is each "
        "study's own (its head-to-head family, Holm-adjusted); \"faster\" is each study's speed verdict, which "
        "measures epochs to its own validation threshold.",
        "", "## Each variant", "", *variants_table(earlier, new), *(["", f"![against]({plot})"] if plot else []),
        "", "## Each head-to-head comparison", "",
        "ΔWER is the first minus the second in WER points (negative: the first is better), * significant.", "",
        *comparisons_table(earlier, new), "",
        "Of the comparisons in both: " + ", ".join(f"{n} {r}" for r, n in counts.items()) + ".", ""])


def paired(earlier: Summary, new: Summary) -> list[tuple[dict, dict]]:
    after = by_pair(new)
    return [(c, after[key]) for key, c in by_pair(earlier).items() if key in after]
