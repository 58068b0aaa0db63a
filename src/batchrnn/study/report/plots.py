"""The report's plots, drawn from the summary: validation WER and gradient norm by epoch, test WER
against epoch time, peak memory, test WER by depth when the study varies it, greedy test WER against the word LM's
when runs were decoded with it, and each variant's test WER in an earlier study and this one (`--against`).
"""
from collections import defaultdict
from pathlib import Path

import numpy as np

from batchrnn.config import Impl
from batchrnn.study.report.summary import BN_ORDER, RNN_ORDER, Summary

DEPTH_PLOT = "wer_vs_depth.png"  # only when the study varies model.num_layers
LM_PLOT = "greedy_vs_lm.png"  # only when runs were decoded with the word LM


def draw(summary: Summary, out_dir: Path) -> list[str]:
    """Writes the plots that the summary has data for into out_dir; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    drawn = []
    if per_epoch(summary.curves, "val_wer", out_dir / "val_wer.png", summary.depth):
        drawn.append("val_wer.png")
    if summary.rows:
        wer_vs_time(summary.rows, out_dir / "wer_vs_time.png", drifted=bool(summary.drift))
        peak_mem(summary.rows, out_dir / "peak_mem.png")
        drawn += ["wer_vs_time.png", "peak_mem.png"]
    if per_epoch(summary.curves, "grad_norm", out_dir / "grad_norm.png", summary.depth):
        drawn.append("grad_norm.png")
    if summary.depth and summary.rows:
        wer_vs_depth(summary.rows, out_dir / DEPTH_PLOT)
        drawn.append(DEPTH_PLOT)
    if summary.lm and summary.rows:
        greedy_vs_lm(summary.rows, out_dir / LM_PLOT)
        drawn.append(LM_PLOT)
    return drawn


def colors() -> dict[str, str]:
    """One colour per BN placement, the same in every plot."""
    return {bn: f"C{i}" for i, bn in enumerate(BN_ORDER)}


def style(row: dict) -> dict:
    return dict(color=colors().get(row["bn"]), linestyle="-" if row["impl"] == Impl.fused.value else "--")


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # a title wider than one panel is kept whole, not cut
    plt.close(fig)


def panels(rows: list[dict], depth: bool):
    """A figure with a panel per group of rows (rnn and its other settings): side by side, or, when the
    study varies the depth, a row of panels per rnn and a column per depth. Returns (fig, axes, {group: ax})."""
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in rows}, key=lambda f: min(r["_sort"] for r in rows if r["family"] == f))
    depths = sorted({r["num_layers"] or 0 for r in rows}) if depth else [None]
    shape = (len(families), len(depths)) if depth else (1, len(families))
    fig, axes = plt.subplots(*shape, figsize=(max(7, 5 * shape[1]), 4 * shape[0]), squeeze=False, sharey=True)
    where = {}
    for row in rows:
        ax = axes[families.index(row["family"]), depths.index(row["num_layers"] or 0)] if depth \
            else axes[0, families.index(row["family"])]
        layers = row["num_layers"]
        title = f"{row['family']}, {layers} layer{'s' * (layers != 1)}" if depth else row["group"]
        where[row["group"]] = ax
        ax.set_title(title)
    return fig, axes, where


def per_epoch(rows: list[dict], metric: str, path: Path, depth: bool) -> bool:
    """Validation WER (metric "val_wer") or the pre-clip gradient norm ("grad_norm": the mean step solid,
    the largest dotted, log scale) by epoch, a line per row over its seeds. False when no run has the metric."""
    from matplotlib.ticker import MaxNLocator

    key = "val_wer" if metric == "val_wer" else "grad_norm_mean"
    rows = [r for r in rows if any(e.get(key) is not None for run in r["_runs"] for e in run["epochs"])]
    if not rows:
        return False
    fig, axes, where = panels(rows, depth)
    for row in rows:
        ax, line = where[row["group"]], style(row)
        if metric == "val_wer":
            # Mean over the seeds, band: min-max; a seed that stopped holds its last value to the row's last
            # epoch, so the mean does not jump when one stops (a running run has fewer epochs, not held).
            epochs, values = series(row, "val_wer", 100, hold=True)
            ax.plot(epochs, [np.mean(v) for v in values], label=row["name"], **line)
            if len(row["_runs"]) > 1:
                ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values], alpha=0.15,
                                color=line["color"], linewidth=0)
        else:
            epochs, means = series(row, "grad_norm_mean")
            ax.plot(epochs, [np.mean(v) for v in means], label=row["name"], **line)
            epochs, peaks = series(row, "grad_norm_max")
            ax.plot(epochs, [max(v) for v in peaks], color=line["color"], linestyle=":", linewidth=1)
            ax.set_yscale("log")
    for ax in axes.flat:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("validation WER %" if metric == "val_wer" else "pre-clip gradient norm")
    fig.suptitle("Validation WER per epoch (mean over seeds, band: min-max; a stopped seed holds its last value)"
                 if metric == "val_wer" else
                 "Pre-clip gradient norm per epoch (solid: mean step, over seeds; dotted: largest step)", fontsize=11)
    save(fig, path)
    return True


def series(row: dict, key: str, scale: float = 1.0, hold: bool = False) -> tuple[list[int], list[list[float]]]:
    """(epochs, the values of each epoch over the row's runs) for one per-epoch metric. hold: a run that
    stopped (finished or diverged) keeps its last value for every later epoch of the row's other runs."""
    by_epoch, last = defaultdict(list), {}
    for i, run in enumerate(row["_runs"]):
        for e in run["epochs"]:
            if e.get(key) is not None and e.get("epoch") is not None:
                by_epoch[e["epoch"]].append(scale * e[key])
                last[i] = (e["epoch"], scale * e[key])
    epochs = sorted(by_epoch)
    if hold:
        for i, (stopped_at, value) in last.items():
            if row["_runs"][i]["status"] in ("finished", "diverged"):
                for epoch in epochs:
                    if epoch > stopped_at:
                        by_epoch[epoch].append(value)
    return epochs, [by_epoch[e] for e in epochs]


def wer_vs_time(rows: list[dict], path: Path, drifted: bool = False) -> None:
    """drifted: the machine's speed changed while the study ran (Summary.drift), which the title says."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    markers = dict(zip(RNN_ORDER, "osD"))
    for row in rows:
        x, y, color = row["epoch_time_s"], 100 * row["test_wer"], colors().get(row["bn"])
        # Marker shape: rnn; colour: BN placement; hollow: the cells implementation.
        xerr, yerr = np.nan_to_num(row["epoch_time_s_std"]), np.nan_to_num(100 * row["test_wer_std"])
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, marker=markers.get(row["rnn"], "^"), color=color, capsize=2,
                    elinewidth=0.8, markerfacecolor=color if row["impl"] == Impl.fused.value else "none")
        # its rate: the tables
        ax.annotate(row["variant"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    times = [r["epoch_time_s"] for r in rows if r["epoch_time_s"] > 0]
    if times and max(times) > 5 * min(times):  # the cells reference is tens of times slower than fused
        ax.set_xscale("log")
    ax.margins(x=0.15)  # room for the labels of the rightmost points
    title = "Test WER against epoch time (mean ± std)"
    if drifted:
        title += "\nepoch times drifted during the study: not costs (report.md)"
    ax.set(xlabel="epoch time s", ylabel="test WER %", title=title)
    ax.grid(alpha=0.3)
    save(fig, path)


def greedy_vs_lm(rows: list[dict], path: Path) -> None:
    """Each variant's greedy test WER (x) against its test WER with the word LM (y): below the diagonal, the LM
    helped; a variant the LM helps more than another moves further down."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    markers = dict(zip(RNN_ORDER, "osD"))
    decoded = [r for r in rows if r.get("lm_n")]
    for row in decoded:
        x, y, color = 100 * row["test_wer"], 100 * row["lm_test_wer"], colors().get(row["bn"])
        ax.errorbar(x, y, xerr=np.nan_to_num(100 * row["test_wer_std"]), yerr=np.nan_to_num(100 * row["lm_test_wer_std"]),
                    marker=markers.get(row["rnn"], "^"), color=color, capsize=2, elinewidth=0.8,
                    markerfacecolor=color if row["impl"] == Impl.fused.value else "none")
        ax.annotate(row["variant"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    values = [100 * r[k] for r in decoded for k in ("test_wer", "lm_test_wer")]
    if values:
        edge = (0, max(values) * 1.1)
        ax.plot(edge, edge, color="grey", linewidth=0.8, linestyle=":")  # no change from the LM
    ax.set(xlabel="greedy test WER %", ylabel="test WER % with the word LM",
           title="Greedy against word-LM decoding (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    save(fig, path)


def peak_mem(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    # Bars grouped as the rows are (rnn, depth, ...) with a gap between groups, coloured by placement.
    x, positions, group = 0, [], None
    for row in rows:
        x += 1 if row["group"] == group or group is None else 2
        group = row["group"]
        positions.append(x)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * x + 2), 4.5))
    ax.bar(positions, [r["peak_mem_mb"] for r in rows], color=[colors().get(r["bn"]) for r in rows],
           yerr=[np.nan_to_num(r["peak_mem_mb_std"]) for r in rows], capsize=3)
    ax.set_xticks(positions, [r["label"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set(ylabel="peak memory MB", title="Peak memory per variant (mean over seeds)")
    ax.grid(alpha=0.3, axis="y")
    save(fig, path)


def wer_vs_depth(rows: list[dict], path: Path) -> None:
    """DS2 Table 1 as a plot: test WER against the number of recurrent layers, one line per placement."""
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in rows))  # rows come sorted
    fig, axes = plt.subplots(1, len(families), figsize=(max(6, 5 * len(families)), 4), squeeze=False, sharey=True)
    for ax, family in zip(axes[0], families):
        lines = defaultdict(list)
        for row in rows:
            if row["family"] == family:
                lines[row["depth_free"]].append(row)
        for points in lines.values():
            x, y = [p["num_layers"] for p in points], [100 * p["test_wer"] for p in points]
            ax.errorbar(x, y, yerr=[np.nan_to_num(100 * p["test_wer_std"]) for p in points], marker="o",
                        capsize=3, label=points[0]["placement"], **style(points[0]))
            for p, xi, yi in zip(points, x, y):
                if p["significant"]:
                    ax.annotate("*", (xi, yi), xytext=(4, 4), textcoords="offset points")
        ax.set(title=family, xlabel="recurrent layers")
        ax.set_xticks(sorted({r["num_layers"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("test WER %")
    fig.suptitle("Test WER by depth (mean ± std over seeds; * differs from none, Holm-adjusted)")
    save(fig, path)


def earlier_vs_new(pairs: list[tuple[dict | None, dict | None]], path: Path, earlier: str, new: str) -> None:
    """Each variant's test WER in two studies, an arrow from the earlier (open marker) to the new (filled), mean ±
    std over seeds; a panel per rnn (and its other settings but depth). pairs: (earlier row, new row), None where a
    study lacks the variant."""
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys((b or a)["family"] for a, b in pairs))
    tallest = max(sum((b or a)["family"] == f for a, b in pairs) for f in families)
    fig, axes = plt.subplots(1, len(families), figsize=(max(6, 5 * len(families)), 1.2 + 0.4 * tallest),
                             squeeze=False, sharex=True)
    for ax, family in zip(axes[0], families):
        shown = [(a, b) for a, b in pairs if (b or a)["family"] == family]
        for y, (a, b) in enumerate(shown):
            color = colors().get((b or a)["bn"])
            for row, dy, filled in ((a, -0.15, False), (b, 0.15, True)):  # earlier just above, new just below
                if row is not None:
                    ax.errorbar(100 * row["test_wer"], y + dy, xerr=np.nan_to_num(100 * row["test_wer_std"]), fmt="o",
                                capsize=3, color=color, markerfacecolor=color if filled else "white")
            if a is not None and b is not None:
                ax.annotate("", xy=(100 * b["test_wer"], y + 0.15), xytext=(100 * a["test_wer"], y - 0.15),
                            arrowprops=dict(arrowstyle="->", color=color, alpha=0.5))
        ax.set_yticks(range(len(shown)), [(b or a)["variant"] for a, b in shown])
        ax.set_ylim(len(shown) - 0.5, -0.5)  # the tables' order, top down
        ax.set(title=family, xlabel="test WER %")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"Test WER: {earlier} (open) to {new} (filled), mean ± std over seeds")
    save(fig, path)
