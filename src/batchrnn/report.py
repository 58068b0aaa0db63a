"""The study report: one table, a bootstrap over seeds and paired test utterances against `none`, the
plots, from a sweep's results.

    python -m batchrnn.report SWEEP_DIR [--out DIR] [--wandb]    # report.md, report.json and *.png

A sweep that varies model.num_layers (experiment=an4_depth) gets a row per depth and a WER-by-depth plot.
"""
import argparse
import json
import math
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import jiwer
import numpy as np

from batchrnn.config import BNMode, Impl, LoggerConfig, LoggerMode, RNNType

RNN_ORDER = [r.value for r in RNNType]
BN_ORDER = [b.value for b in BNMode]  # none, post, input, skip, seqwise
IMPL_ORDER = [i.value for i in Impl]
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 1000, 0
PLOTS = ("val_wer.png", "wer_vs_time.png", "peak_mem.png")
DEPTH_PLOT = "wer_vs_depth.png"  # only when the sweep varies model.num_layers


# ----------------------------------------------------------------------------------------------------
# reading


def variant(result: dict) -> tuple[str, str, str, int | None]:
    """(rnn, bn, impl, num_layers) from the top-level keys, or the config's model section (results files
    keep num_layers there only; a report row has it at the top)."""
    model = result.get("config", {}).get("model", {})
    return tuple(result.get(k, model.get(k)) for k in ("rnn", "bn", "impl", "num_layers"))


def varies_depth(keys) -> bool:
    return len({key[3] for key in keys}) > 1


def label(key: tuple, depth: bool = False) -> str:
    """rnn-bn[-impl], and -L<layers> when the sweep varies the depth."""
    rnn, bn, impl, layers = key
    return f"{rnn}-{bn}" + ("" if impl == Impl.fused.value else f"-{impl}") + (f"-L{layers}" if depth else "")


def sort_key(key: tuple) -> tuple:
    def rank(order, x):
        return (order.index(x), x) if x in order else (len(order), x)

    return rank(RNN_ORDER, key[0]), key[3] or 0, rank(BN_ORDER, key[1]), rank(IMPL_ORDER, key[2])


def load_results(sweep_dir: Path) -> tuple[list[dict], list[dict], list[Path]]:
    """(finished, running, skipped) results under sweep_dir; unreadable files warn and are skipped."""
    finished, running, skipped = [], [], []
    for path in sorted(sweep_dir.rglob("results.json")):
        try:
            result = json.loads(path.read_text())
            if not isinstance(result, dict) or None in variant(result)[:3]:
                raise ValueError("not a results file with rnn, bn and impl")
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            warnings.warn(f"skipping {path}: {e}; rerun that run or delete the file", stacklevel=2)
            skipped.append(path)
            continue
        (finished if result.get("status") == "finished" else running).append(result)
    return finished, running, skipped


# ----------------------------------------------------------------------------------------------------
# statistics


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
        errors = w.substitutions + w.deletions + w.insertions
        out[u["id"]] = (errors, w.hits + w.substitutions + w.deletions)
    return out


def paired_bootstrap(variant_runs: list[dict], none_runs: list[dict]) -> tuple[float, float, float] | None:
    """WER difference variant - none (fraction, seeds pooled) and its 95% CI by a two-level bootstrap:
    each resample draws each variant's seeds with replacement, then test utterances, the same for both."""
    # A run without per-utterance outputs (an old or damaged results file) cannot be paired: left out.
    v, n = ([p for p in map(utterance_errors, runs) if p] for runs in (variant_runs, none_runs))
    if not v or not n:
        return None
    ids = sorted(set.intersection(*(set(p) for p in v + n)))
    if not ids:
        return None
    ev, en = (np.array([[p[u][0] for u in ids] for p in runs], dtype=float) for runs in (v, n))  # (seeds, utts)
    ref = np.array([n[0][u][1] for u in ids], dtype=float)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    # Seeds first: one seed that failed to train is seed-to-seed variation, which an interval over
    # utterances alone would pass off as a real difference. With one seed per variant this is a no-op.
    sv = rng.integers(0, len(ev), size=(BOOTSTRAP_RESAMPLES, len(ev)))
    sn = rng.integers(0, len(en), size=(BOOTSTRAP_RESAMPLES, len(en)))
    # The same resampled utterances for both systems: that pairing is what makes the test sensitive.
    idx = rng.integers(0, len(ids), size=(BOOTSTRAP_RESAMPLES, len(ids)))
    mv = np.take_along_axis(ev[sv].mean(1), idx, axis=1).sum(1)  # (resamples,) word errors
    mn = np.take_along_axis(en[sn].mean(1), idx, axis=1).sum(1)
    diffs = (mv - mn) / np.maximum(ref[idx].sum(1), 1.0)
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return float((ev.mean(0).sum() - en.mean(0).sum()) / max(ref.sum(), 1.0)), float(lo), float(hi)


def aggregate(finished: list[dict]) -> list[dict]:
    """One row per (rnn, bn, impl, num_layers): means and stds over seeds, ratios and the bootstrap vs
    the `none` row of the same rnn and depth."""
    groups = defaultdict(list)
    for r in finished:
        groups[variant(r)].append(r)
    depth = varies_depth(groups)
    rows = []
    for key in sorted(groups, key=sort_key):
        runs = groups[key]
        runs.sort(key=lambda r: r.get("seed") or 0)  # every results.json has one; 0 is the default
        row = dict(zip(("rnn", "bn", "impl", "num_layers"), key), label=label(key, depth), n=len(runs),
                   seeds=[r.get("seed") for r in runs], test_wer_by_seed=[r.get("test_wer") for r in runs])
        for name in ("test_wer", "test_cer", "best_val_wer", "epoch_time_s", "peak_mem_mb"):
            row[name], row[f"{name}_std"] = mean_std([r.get(name) for r in runs])
        row["params"] = mean_std([r.get("params") for r in runs])[0]  # the same for every seed
        rows.append(row)
    by_key = {variant(r): r for r in rows}
    for row in rows:
        none = by_key.get((row["rnn"], BNMode.none.value, Impl.fused.value, row["num_layers"]))
        # Ratios of means, both measured in this sweep: the cost of a placement over no BN.
        for name, ratio in (("epoch_time_s", "time_ratio"), ("peak_mem_mb", "mem_ratio")):
            row[ratio] = row[name] / none[name] if none and none[name] else math.nan
        test = None
        if none and row is not none:
            test = paired_bootstrap(groups[variant(row)], groups[variant(none)])
        row["dwer"], row["dwer_lo"], row["dwer_hi"] = test or (math.nan,) * 3
        row["significant"] = bool(test and (test[1] > 0 or test[2] < 0))
    return rows


# ----------------------------------------------------------------------------------------------------
# plots


def bn_colors() -> dict[str, str]:
    """One colour per BN placement, the same in every plot."""
    return {bn: f"C{i}" for i, bn in enumerate(BN_ORDER)}


def plot_val_wer(results: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # One panel per rnn side by side; when the sweep varies the depth, a row per rnn, a column per depth.
    depth = varies_depth([variant(r) for r in results])
    panels = defaultdict(lambda: defaultdict(list))
    for r in results:
        key = variant(r)
        epochs = r.get("epochs") or []
        panels[key[0], key[3] if depth else None][key].append({e["epoch"]: 100 * e["val_wer"] for e in epochs
                                                              if None not in (e.get("epoch"), e.get("val_wer"))})
    rnns = sorted({rnn for rnn, _ in panels}, key=lambda x: sort_key((x, "", "", 0)))
    depths = sorted({layers for _, layers in panels}, key=lambda x: x or 0)
    shape = (len(rnns), len(depths)) if depth else (1, len(rnns))
    fig, axes = plt.subplots(*shape, figsize=(5 * shape[1], 4 * shape[0]), squeeze=False, sharey=True)
    colors = bn_colors()
    for (rnn, layers), curves_of in panels.items():
        ax = axes[rnns.index(rnn), depths.index(layers)] if depth else axes[0, rnns.index(rnn)]
        for key in sorted(curves_of, key=sort_key):
            curves = curves_of[key]
            epochs = sorted(set().union(*curves))
            if not epochs:
                continue
            # Mean over the seeds that reached each epoch: running runs stop early, so n varies.
            values = [[c[e] for c in curves if e in c] for e in epochs]
            style = dict(color=colors.get(key[1]), linestyle="-" if key[2] == Impl.fused.value else "--")
            ax.plot(epochs, [np.mean(v) for v in values], label=label(key)[len(rnn) + 1:], **style)
            if len(curves) > 1:
                ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values],
                                alpha=0.15, color=style["color"], linewidth=0)
        ax.set(title=rnn if layers is None else f"{rnn}, {layers} layer{'s' * (layers != 1)}", xlabel="epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("validation WER %")
    fig.suptitle("Validation WER per epoch (mean over seeds, band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_wer_vs_time(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    colors, markers = bn_colors(), dict(zip(RNN_ORDER, "osD"))
    for row in rows:
        x, y, color = row["epoch_time_s"], 100 * row["test_wer"], colors.get(row["bn"])
        # Marker shape: rnn; colour: BN placement; hollow: the cells implementation.
        xerr, yerr = np.nan_to_num(row["epoch_time_s_std"]), np.nan_to_num(100 * row["test_wer_std"])
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, marker=markers.get(row["rnn"], "^"), color=color, capsize=2,
                    elinewidth=0.8, markerfacecolor=color if row["impl"] == Impl.fused.value else "none")
        ax.annotate(row["label"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    times = [r["epoch_time_s"] for r in rows if r["epoch_time_s"] > 0]
    if times and max(times) > 5 * min(times):  # the cells reference is tens of times slower than fused
        ax.set_xscale("log")
    ax.margins(x=0.15)  # room for the labels of the rightmost points
    ax.set(xlabel="epoch time s", ylabel="test WER %", title="Test WER against epoch time (mean ± std)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_peak_mem(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    # Bars grouped by rnn (and depth) with a gap between groups, coloured by BN placement.
    x, positions, group = 0, [], None
    for row in rows:
        x += 1 if (row["rnn"], row["num_layers"]) == group or group is None else 2
        group = row["rnn"], row["num_layers"]
        positions.append(x)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * x + 2), 4.5))
    colors = bn_colors()
    ax.bar(positions, [r["peak_mem_mb"] for r in rows], color=[colors.get(r["bn"]) for r in rows],
           yerr=[np.nan_to_num(r["peak_mem_mb_std"]) for r in rows], capsize=3)
    ax.set_xticks(positions, [r["label"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set(ylabel="peak memory MB", title="Peak memory per variant (mean over seeds)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_wer_vs_depth(rows: list[dict], path: Path) -> None:
    """DS2 Table 1 as a plot: test WER against the number of recurrent layers, one line per placement."""
    import matplotlib.pyplot as plt

    rnns = list(dict.fromkeys(r["rnn"] for r in rows))  # rows come sorted
    fig, axes = plt.subplots(1, len(rnns), figsize=(max(6, 5 * len(rnns)), 4), squeeze=False, sharey=True)
    colors = bn_colors()
    for ax, rnn in zip(axes[0], rnns):
        lines = defaultdict(list)
        for row in rows:
            if row["rnn"] == rnn:
                lines[row["bn"], row["impl"]].append(row)
        for (bn, impl), points in lines.items():
            x, y = [p["num_layers"] for p in points], [100 * p["test_wer"] for p in points]
            ax.errorbar(x, y, yerr=[np.nan_to_num(100 * p["test_wer_std"]) for p in points], marker="o",
                        capsize=3, color=colors.get(bn), linestyle="-" if impl == Impl.fused.value else "--",
                        label=bn if impl == Impl.fused.value else f"{bn}-{impl}")
            for p, xi, yi in zip(points, x, y):
                if p["significant"]:
                    ax.annotate("*", (xi, yi), xytext=(4, 4), textcoords="offset points")
        ax.set(title=rnn, xlabel="recurrent layers")
        ax.set_xticks(sorted({r["num_layers"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("test WER %")
    fig.suptitle("Test WER by depth (mean ± std over seeds; * differs from none)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# writing


def fmt(row: dict, name: str, scale: float = 1.0, digits: int = 1) -> str:
    """row[name] as "mean ± std" (the std from row[name + "_std"] when there is one), "–" when missing."""
    mean, std = row[name], row.get(f"{name}_std", math.nan)
    if mean is None or math.isnan(mean):
        return "–"
    s = f"{scale * mean:,.{digits}f}"
    return s if math.isnan(std) else f"{s} ± {scale * std:,.{digits}f}"


def fmt_dwer(row: dict) -> str:
    if math.isnan(row["dwer"]):
        return "–" if row["bn"] != BNMode.none.value else "(baseline)"
    s = f"{100 * row['dwer']:+.1f} [{100 * row['dwer_lo']:+.1f}, {100 * row['dwer_hi']:+.1f}]"
    return f"{s} *" if row["significant"] else s


def table(rows: list[dict]) -> list[str]:
    depth = varies_depth([variant(r) for r in rows])
    keys = ["rnn"] + ["layers"] * depth + ["bn", "impl"]
    head = keys + ["n", "test WER %", "test CER %", "best val WER %", "epoch time s", "peak mem MB",
                   "time × none", "mem × none", "params", "ΔWER vs none [95% CI]"]
    # Bold the best test WER within each rnn (and depth): the study compares placements for one cell type.
    best = {}
    for row in rows:
        group = row["rnn"], row["num_layers"]
        if not math.isnan(row["test_wer"]) and row["test_wer"] < best.get(group, math.inf):
            best[group] = row["test_wer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(keys) + "---:|" * (len(head) - len(keys))]
    for row in rows:
        wer = fmt(row, "test_wer", 100)
        cells = [row["rnn"]] + [str(row["num_layers"])] * depth + [row["bn"], row["impl"], str(row["n"]),
                 f"**{wer}**" if row["test_wer"] == best.get((row["rnn"], row["num_layers"])) else wer,
                 fmt(row, "test_cer", 100), fmt(row, "best_val_wer", 100), fmt(row, "epoch_time_s"),
                 fmt(row, "peak_mem_mb", digits=0), fmt(row, "time_ratio", digits=2),
                 fmt(row, "mem_ratio", digits=2), fmt(row, "params", digits=0), fmt_dwer(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def depth_effect(rows: list[dict]) -> list[str]:
    """ΔWER vs none per depth, a row per placement: DS2's Table 1 asks whether BN helps more when deeper."""
    depths = sorted({r["num_layers"] for r in rows})
    by_depth = defaultdict(dict)
    for row in rows:
        if row["bn"] != BNMode.none.value:
            by_depth[row["rnn"], row["bn"], row["impl"]][row["num_layers"]] = row
    lines = ["| rnn | bn | impl | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|" + "---|" * 3 + "---:|" * len(depths)]
    for key, rows_at in by_depth.items():
        cells = list(key) + [fmt_dwer(rows_at[d]) if d in rows_at else "–" for d in depths]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def significance(rows: list[dict]) -> str:
    tested = [r for r in rows if not math.isnan(r["dwer"])]
    if not tested:
        return "No paired comparison: no variant has per-utterance test outputs beside its `none` baseline."
    sig = [r for r in tested if r["significant"]]
    if not sig:
        return f"No WER difference to `none` is significant (all {len(tested)} 95% intervals include 0)."
    parts = [f"{r['label']} ({100 * r['dwer']:+.1f} points, {'better' if r['dwer'] < 0 else 'worse'})"
             for r in sig]
    return (f"Significant at 95% (interval excludes 0, marked *): {', '.join(parts)}; "
            f"not significant: {len(tested) - len(sig)} of {len(tested)}.")


def distinct(results: list[dict], key: str) -> str:
    values = sorted({str(r[key]) for r in results if r.get(key) is not None})
    return ", ".join(values) or "unknown"


def json_ready(x):
    """NaN becomes null: report.json stays strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_ready(v) for v in x]
    return x


HOW_TO_READ = f"""\
Each row is one variant (rnn, BN placement, implementation); values are the mean ± sample std over its
n seeds (no ± for a single seed). Test WER is that of the epoch with the best validation WER; the best
test WER of each rnn is in bold. Time and memory ratios divide by the `none` row of the same rnn: they
were measured in this sweep on one machine, so they rank the variants' costs but do not transfer to other
hardware (peak memory is CUDA max allocated on a GPU, process peak RSS on the CPU). ΔWER is variant minus
`none` in WER points (each utterance's word errors averaged over seeds), with a 95% interval from a
two-level bootstrap ({BOOTSTRAP_RESAMPLES} resamples): each draws both variants' seeds with replacement,
then the test utterances, the same ones for both; so the interval holds seed-to-seed variation as well as
the test set's (with one seed, only the latter). * marks an interval that excludes 0.
When the sweep varies model.num_layers, every comparison (bold, ratios, ΔWER) is within one depth.
"""


def header(finished: list[dict], running: list[dict], skipped: list[Path], diverged: int) -> list[str]:
    everything = finished + running
    devices = distinct(everything, "device")
    lines = [
        f"# Study report: {distinct(everything, 'study')}",
        "",
        f"- Preset: {distinct(everything, 'preset')}",
        f"- Device: {devices}; torch {distinct(everything, 'torch_version')}",
        f"- Runs: {len(finished)} finished, {len(running) - diverged} still running"
        + (f", {diverged} diverged (the `error` in its results.json says where)" if diverged else "")
        + " (unfinished runs: in the per-epoch plot only)"
        + (f", {len(skipped)} unreadable and skipped" if skipped else ""),
    ]
    if "cpu" in devices.split(", "):
        lines.append("- The CPU-sized preset was used: a small model and few epochs, so absolute WERs are "
                     "far above full-size DS2 numbers; compare variants with each other, not with the "
                     "literature.")
    return lines


def write_report(sweep_dir: Path, out_dir: Path | None = None, wandb: LoggerMode | None = None) -> Path:
    """Writes report.md, report.json and the PNGs for the results.json files under sweep_dir (default
    out_dir: sweep_dir) and, with a wandb mode, logs them to W&B too; returns the path of report.md."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such folder; pass the folder that holds the sweep's runs")
    finished, running, skipped = load_results(sweep_dir)
    if not finished and not running:
        raise FileNotFoundError(f"{sweep_dir}: no readable results.json under it; has any run started?")
    out_dir = Path(out_dir) if out_dir else sweep_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    rows = aggregate(finished)
    diverged = sum(r.get("status") == "diverged" for r in running)  # stopped by TrainingDiverged

    plot_val_wer(finished + running, out_dir / "val_wer.png")
    plots = ["val_wer.png"]
    if rows:
        plot_wer_vs_time(rows, out_dir / "wer_vs_time.png")
        plot_peak_mem(rows, out_dir / "peak_mem.png")
        plots += ["wer_vs_time.png", "peak_mem.png"]
    depth = varies_depth([variant(r) for r in rows])
    if depth:
        plot_wer_vs_depth(rows, out_dir / DEPTH_PLOT)
        plots.append(DEPTH_PLOT)

    lines = header(finished, running, skipped, diverged) + ["", "## How to read", "", HOW_TO_READ, "## Results", ""]
    lines += table(rows) + ["", significance(rows)] if rows else ["No finished runs yet."]
    if depth:
        lines += ["", "## BN's effect by depth", "", "ΔWER vs `none` at the same depth, in WER points with its "
                  "95% interval (* excludes 0): DS2's Table 1 design, which reported BN helping more the deeper "
                  "the network.", ""] + depth_effect(rows)
    lines += ["", "## Plots", ""] + [f"![{p.removesuffix('.png')}]({p})" for p in plots]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")

    everything = finished + running
    summary = {"sweep_dir": str(sweep_dir), "study": distinct(everything, "study"),
               "preset": distinct(everything, "preset"), "devices": distinct(everything, "device"),
               "finished": len(finished), "diverged": diverged, "running": len(running) - diverged, "skipped": [str(p) for p in skipped],
               "significance": significance(rows) if rows else None, "plots": plots, "rows": rows}
    (out_dir / "report.json").write_text(json.dumps(json_ready(summary), indent=2) + "\n")
    if wandb is not None:
        log_to_wandb(out_dir, json_ready(summary), logger_of(everything, wandb))
    return report


# ----------------------------------------------------------------------------------------------------
# W&B


def logger_of(results: list[dict], mode: LoggerMode) -> LoggerConfig:
    """The runs' own W&B project, entity and tags, so the report lands beside them."""
    logger = next((r["config"]["logger"] for r in results if "logger" in r.get("config", {})), {})
    return LoggerConfig(mode=mode, project=logger.get("project", LoggerConfig.project),
                        entity=logger.get("entity"), tags=logger.get("tags", []))


def log_to_wandb(out_dir: Path, summary: dict, logger: LoggerConfig) -> str:
    """The report as a W&B run of job_type "report" in the study's group: the table (a row per variant,
    sortable), the plots, and the significance sentence in the summary. Its run lives in
    out_dir/wandb-report/; online or offline as start_tracking decides. Returns the tracking mode."""
    from batchrnn.tracking import start_tracking

    config = {k: summary[k] for k in ("sweep_dir", "study", "preset", "devices")}
    tracker = start_tracking(logger, Path(out_dir) / "wandb-report", "report", summary["study"], config,
                             job_type="report")
    rows = summary["rows"]
    if rows:
        columns = list(rows[0])
        tracker.log_table("report/table", columns, [
            [", ".join(map(str, v)) if isinstance(v, list) else v for v in row.values()] for row in rows])
    for plot in summary["plots"]:
        tracker.log_image(f"report/{plot.removesuffix('.png')}", Path(out_dir) / plot)
    tracker.summary({k: summary[k] for k in ("finished", "running", "significance")})
    tracker.finish()
    where = Path(out_dir) / "wandb-report" / "wandb"
    print({"online": "W&B: report logged online",
           "offline": f"W&B: report logged offline, upload with `wandb sync {where}/offline-run-*`"}.get(
        tracker.mode, "W&B: could not start (see the warning above); the report is only on disk"))
    return tracker.mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep's folder (searched recursively)")
    parser.add_argument("--out", type=Path, help="where to write the report (default: SWEEP_DIR)")
    parser.add_argument("--wandb", action="store_true",
                        help="also log the table and plots as a W&B run of job_type report in the study's "
                             "group (online with an API key, else offline under OUT/wandb-report)")
    args = parser.parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    try:
        path = write_report(args.sweep_dir, args.out, LoggerMode.auto if args.wandb else None)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
