"""The one summary of a study that every table, plot and renderer reads: the runs read once, grouped
into rows of one setting each (seeds of it, never two settings), the protocol's rate choice, both
verdicts (quality at convergence, speed of convergence) and the head-to-head comparisons.
"""
import json
import logging
import math
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from batchrnn.config import BNMode, Impl, RNNType, Schedule
from batchrnn.config import Stage
from batchrnn.study.protocol import patience_step, protocol_choice, schedule_of
from batchrnn.training.identity import (AUGMENT, LR, SCHEDULE, SEED, augment_on, canonical, known_settings, placement,
                                        settings, variant_key)
from batchrnn.study.report.stats import ALPHA, first_reach, holm, mean_std, paired_bootstrap, utterance_errors
from batchrnn.training.rundir import read_study

log = logging.getLogger(__name__)

RNN, BN, IMPL, DEPTH = "model.rnn", "model.bn", "model.impl", "model.num_layers"
# What a run computed on, from its results (train.device may say only "auto"): float32 on a CPU and bf16
# autocast on a GPU are two settings, never seeds of one. A row's name shows it when rows differ in it.
COMPUTED = "device"
RNN_ORDER, BN_ORDER, IMPL_ORDER = ([m.value for m in e] for e in (RNNType, BNMode, Impl))
NONE, EXACT = BNMode.none.value, BNMode.seqwise.value
# Head to head, per group: every variant against `none`, and exact DS2 against every other placement;
# and a step-loop variant against the fused one it adds to, whose price it must earn: the full LayerNorm
# RNN (LN of U h and the cell too) against LN of W x alone.
REFERENCES = (NONE, EXACT)
BUILDS_ON = {BNMode.ln_full.value: BNMode.ln.value}
METRICS = ("test_wer", "test_cer", "best_val_wer", "train_loss_at_best", "epoch_time_s", "peak_mem_mb")
# A "running" run with no file written for this long has no live owner: it was stopped (a signal, a
# lost job). Generous, since a results file is written once an epoch and validation is not timed.
STALE_MIN_S, STALE_EPOCHS = 600, 3
# Seeds of one setting compute the same epochs, so their median epoch times differ by a few percent on a
# steady machine; more than this (max over min) means its speed drifted while the study ran. Epochs under
# DRIFT_MIN_S (smoke runs) are too short for their spread to say anything about the machine.
DRIFT, DRIFT_MIN_S = 1.15, 1.0
STATUS_RANK = {"finished": 3, "diverged": 2, "running": 1, "stopped": 0}  # which of two copies to keep


@dataclass
class Summary:
    sweep_dir: str
    study: str
    preset: str
    devices: str
    machines: list[str]  # what ran the epochs; time ratios across several compare machines as well as variants
    # torch threads per run -> runs: two 1-thread jobs at once each run slower than one 2-thread job
    threads: dict[str, int]
    ranks: dict[int, int]  # data-parallel ranks per run (results.json's world_size, 1 before it was recorded) -> runs
    torch: str
    counts: dict[str, int]  # runs by status: finished, running, stopped (no live owner), diverged
    unreadable: list[str]  # results.json paths that could not be read
    duplicates: list[str]  # run folders left out: the same settings and seed as a kept one
    stopped: list[str]  # run folders whose run has no live owner: resume each with its own command
    protocol: dict | None  # {"lrs", "tune_seeds", "seeds", "seed_lists", "widen"} when the study tunes rates
    tuning: list[dict]  # per variant: label, by_lr {rate: mean best val WER}, the chosen lr, missing (lr, seed)
    off_grid: list[str]  # labels of rows at a rate outside their variant's grid: in no table
    columns: list[str]  # the settings that vary across rows beyond rnn, bn and impl: table columns, labels
    depth: bool  # the study varies model.num_layers
    rows: list[dict]  # the verdict: a row per setting with finished runs (at its chosen rate under a protocol)
    failed: list[str]  # labels of settings of the verdict whose every run diverged: in no table
    curves: list[dict]  # rows whose per-epoch curves are plotted: the verdict's and those of variants still tuning
    comparisons: list[dict]  # head to head, Holm-adjusted over all of them
    unpaired: list[str]  # per group, the reference (`none`, `seqwise`) it lacks, so comparisons it cannot make
    compute: dict  # hours of training spent on the study's runs: training_time
    drift: list[dict]  # rows whose seeds' epoch times differ by more than DRIFT: time_drift
    only: dict  # {setting: [values]}: the runs kept (`--only`), and how many others the folder holds
    logger: dict  # the runs' W&B project, entity and tags
    commits: dict[str, int]  # the code's commit each run was trained at (results.json's "commit") -> runs
    preregistered: dict | None  # under a protocol: whether the verdict's seeds are the preset's (preregistration)
    # Decoded with the word LM as well (results.json's `lm`, batchrnn.decoding): a second family of comparisons,
    # Holm-corrected on its own, over the rows whose every seed was decoded; None when no run was (lm_family).
    lm: dict | None = None
    # With the inference bench's file (`--inference`, batchrnn.study.report.serving): its configuration, machine and
    # path; each row then has serve_ratio and serve_way. None without it.
    inference: dict | None = None


def build(sweep_dir: Path, now: float | None = None, only: dict[str, list[str]] | None = None) -> Summary:
    """Reads every results.json under sweep_dir and builds the summary; raises FileNotFoundError when
    there is nothing to report. only: {setting: [values]} keeps the runs with one of those values of each
    (e.g. the grid's placements of a folder that also holds other normalisations: the comparisons, and so
    the family Holm corrects over, are those of the runs kept); FilterError names an unknown setting."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such folder; pass the folder that holds the sweep's runs")
    results, unreadable = read_study(sweep_dir)
    for r in [r for r in results if not {RNN, BN} <= settings(r["config"]).keys()]:
        log.warning("skipping %s: not a results file with model.rnn and model.bn", r["path"])
        results.remove(r)
        unreadable.append(Path(r["path"]) / "results.json")
    if not results:
        raise FileNotFoundError(f"{sweep_dir}: no readable results.json under it; has any run started?")
    now = time.time() if now is None else now
    records, left_out = [run_record(r, now) for r in results], 0
    if only:
        check_filter(only, records)
        kept_records = [run for run in records if selected(config_settings(run), only)]
        left_out, records = len(records) - len(kept_records), kept_records
        if not records:
            raise FileNotFoundError(f"{sweep_dir}: no run has {shown(only)}")
    runs, duplicates = by_setting(records)
    kept = [run["result"] for group in runs.values() for run in group]
    protocol = protocol_of(kept)
    choice = protocol_choice(kept, protocol, tuple(protocol["schedule"] or ())) if protocol else {}
    devices = defaultdict(set)  # the rate is chosen per variant whatever ran it (as the final stage chose it)
    for run in (run for group in runs.values() for run in group):
        devices[variant_key(run["result"]["config"])].add(run["settings"][COMPUTED])
    for key, found in devices.items():
        if protocol and len(found) > 1:
            log.warning("one variant's runs ran on %s: its learning rate was chosen over all of them; a study "
                        "should run on one kind of device (train.device)", " and ".join(sorted(found)))

    columns = varying(runs)
    rows = sorted((make_row(group, columns, protocol, choice) for group in runs.values()), key=lambda r: r["_sort"])
    verdict = [r for r in rows if r["role"] == "verdict" and r["n"]]
    groups = defaultdict(list)
    for row in verdict:
        groups[row["group"]].append(row)
    for members in groups.values():
        add_ratios(members)
        add_speed(members)
    comparisons, unpaired = compare(groups)
    lm = lm_family(verdict)

    counts = Counter(run["status"] for group in runs.values() for run in group)
    return Summary(
        sweep_dir=str(sweep_dir), study=distinct(kept, "study"), preset=distinct(kept, "preset"),
        devices=distinct(kept, "device"), machines=sorted({r["machine"] for r in kept if r.get("machine")}),
        torch=distinct(kept, "torch_version"),
        threads=dict(sorted(Counter(thread_count(r) for r in kept).items(),
                            key=lambda kv: (not kv[0].isdigit(), len(kv[0]), kv[0]))),
        ranks=dict(sorted(Counter(r.get("world_size", 1) for r in kept).items())),
        counts={s: counts[s] for s in ("finished", "running", "stopped", "diverged")},
        unreadable=[str(p) for p in unreadable], duplicates=duplicates, protocol=protocol,
        stopped=[run["path"] for group in runs.values() for run in group if run["status"] == "stopped"],
        tuning=tuning_table(rows, choice, protocol), off_grid=[r["label"] for r in rows if r["role"] == "off_grid"],
        columns=columns, depth=DEPTH in columns, rows=verdict,
        failed=[r["label"] for r in rows if r["role"] == "verdict" and not r["n"] and r["diverged"]],
        curves=[r for r in rows if r["role"] in ("verdict", "pending")], comparisons=comparisons, unpaired=unpaired,
        compute=training_time(rows), drift=time_drift(verdict), only={"settings": only or {}, "left_out": left_out},
        logger=next((r["config"]["logger"] for r in kept if isinstance(r["config"].get("logger"), dict)), {}),
        commits=dict(Counter(r.get("commit") or UNRECORDED for r in kept).most_common()),
        preregistered=preregistration(protocol, verdict, distinct(kept, "preset")) if protocol else None, lm=lm)


UNRECORDED = "not recorded"  # runs trained before results.json recorded the code's commit


def preset_seeds(preset: str) -> list[int] | None:
    """protocol.seeds as the preset (conf/experiment/<preset>.yaml, with its defaults) writes them today; None
    where no such preset composes (a hand-named or removed one)."""
    from hydra import compose, initialize_config_dir  # the report of a plain sweep never needs Hydra
    from hydra.errors import HydraException

    from batchrnn.config import register_configs

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return sorted(compose(config_name="config", overrides=[f"experiment={preset}"]).protocol.seeds)
    except (HydraException, ValueError):
        return None


CONF = Path(__file__).resolve().parents[4] / "conf"


def preregistration(protocol: dict, verdict: list[dict], preset: str) -> dict:
    """Whether the verdict is over seeds fixed before its runs: its preset writes protocol.seeds, every run of the
    study was made with that one list (no seeds added after results were seen), and every verdict row holds
    exactly those seeds (each run to its end, finished or diverged). `held` is False otherwise, and `differ`
    names the rows whose seeds are not the preset's."""
    fixed = preset_seeds(preset) if "," not in preset else None  # runs of several presets: no one preset
    differ = [row["label"] for row in verdict if sorted(r["seed"] for r in row["_trained"]) != fixed]
    return {"preset": preset, "seeds": fixed, "seed_lists": protocol["seed_lists"], "differ": differ,
            "held": fixed is not None and protocol["seed_lists"] == [fixed] and not differ}


# ----------------------------------------------------------------------------------------------------
# runs


class FilterError(ValueError):
    """An `--only` filter that names no setting of the runs."""


def check_filter(only: dict[str, list[str]], records: list[dict]) -> None:
    """Raises FilterError when `only` names a setting that no run has."""
    known = set().union(*(config_settings(run) for run in records))
    unknown = sorted(k for k in only if k not in known)
    if unknown:
        raise FilterError(f"--only {unknown[0]}: not a setting of these runs; use a dotted name of the config, "
                         "e.g. model.bn, model.rnn, model.num_layers, train.lr")


def config_settings(run: dict) -> dict:
    """A run record's settings from its config, without what the report adds (COMPUTED)."""
    return {k: v for k, v in run["settings"].items() if k != COMPUTED}


def selected(s: dict, only: dict[str, list[str]]) -> bool:
    """Whether flat settings s have, for each setting of `only`, one of its values (as typed: numbers by
    value, so 2e-3 is 0.002); a run without the setting has none of them."""
    return all(k in s and any(same(s[k], v) for v in values) for k, values in only.items())


def same(setting, typed: str) -> bool:
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        try:
            return float(typed) == float(setting)
        except ValueError:
            return False
    return value(setting) == typed


def shown(only: dict[str, list[str]]) -> str:
    """model.bn in none, seqwise; model.rnn in gru: a filter as the report names it."""
    return "; ".join(f"{k} in {', '.join(v)}" for k, v in only.items())


def computed_on(result: dict) -> str:
    """"cpu", "cuda bf16", ...: the device type a run trained on, and bf16 autocast where it was on."""
    return f"{result.get('device', 'unknown')}{' bf16' if result.get('bf16') else ''}"


def run_record(result: dict, now: float) -> dict:
    s = known_settings(result["config"]) | {COMPUTED: computed_on(result)}
    if "train_loss_at_best" not in result:  # recorded since issue 28; the same value, from an older run's epochs
        result = result | {"train_loss_at_best": train_loss_at(result)}
    return {"seed": s.get(SEED), "status": status_of(result, now), "path": result["path"], "settings": s,
            "epochs": result.get("epochs") or [], "improving_at_cap": capped(result),
            "result": result}


def capped(result: dict) -> bool:
    """Whether the report marks the run with †: it stopped at the cap or the rate's floor still improving, or,
    under train.schedule=plateau (whose cap is set out of reach, so that runs stop by their own validation), it
    reached the cap at all."""
    plateau = (result["config"].get("train") or {}).get("schedule") == Schedule.plateau.value
    return bool(result.get("improving_at_cap")) or (plateau and result.get("stop") == "cap")


def train_loss_at(result: dict) -> float | None:
    """The training loss of the epoch with the best validation WER (the tested one), None before one."""
    best, epochs = result.get("best_epoch") or 0, result.get("epochs") or []
    return epochs[best - 1].get("train_loss") if 0 < best <= len(epochs) else None


def status_of(result: dict, now: float) -> str:
    """finished, diverged, running, or stopped: "running" in the file, but nothing under the run's folder
    was written for STALE_EPOCHS times its longest epoch (at least STALE_MIN_S)."""
    status = result.get("status")
    if status in ("finished", "diverged"):
        return status
    longest = max((e.get("epoch_time_s") or 0.0 for e in result.get("epochs") or []), default=0.0)
    quiet = now - last_write(Path(result["path"]))
    return "stopped" if quiet > max(STALE_MIN_S, STALE_EPOCHS * longest) else "running"


def last_write(folder: Path) -> float:
    """The newest modification time of any file in a run's folder (results, checkpoint, log, W&B files)."""
    times = []
    for path in folder.rglob("*"):
        try:
            times.append(path.stat().st_mtime)
        except OSError:  # a dangling link (W&B's latest-run), a file removed meanwhile
            pass
    return max(times, default=0.0)


def by_setting(records: list[dict]) -> tuple[dict, list[str]]:
    """{setting key: runs sorted by seed}: a seed appears once per setting. Of two folders with the same
    settings and seed, the one further along is kept and the other reported."""
    groups, duplicates = defaultdict(dict), []
    for run in records:
        seeds = groups[canonical({k: v for k, v in run["settings"].items() if k != SEED})]
        other = seeds.get(run["seed"])
        if other is not None:
            keep, drop = sorted((other, run), key=lambda r: (STATUS_RANK[r["status"]], len(r["epochs"])))[::-1]
            log.warning("%s: the same settings and seed as %s; left out of the report (move or delete one)",
                        drop["path"], keep["path"])
            duplicates.append(drop["path"])
            run = keep
        seeds[run["seed"]] = run
    return {k: sorted(v.values(), key=lambda r: r["seed"] or 0) for k, v in groups.items()}, duplicates


def protocol_of(results: list[dict]) -> dict | None:
    """The study's learning-rate protocol, when its runs were made by one (batchrnn.study.scheduler: stage tune or
    final) with a grid; the commonest if several. Single runs of a preset that has a grid are plain runs.

    Runs that differ in protocol.seeds only are one protocol whose verdict grew seeds (a study run again with
    protocol.seeds=[1,2,3,4,5,6] after [1,2,3]: its tuning is settled, so it trains the new seeds alone): the
    verdict holds the union of their seeds, and `seed_lists` records each list the runs were made with."""
    protocols = [p for r in results if isinstance(p := r["config"].get("protocol"), dict) and p.get("lrs")
                 and p.get("stage", Stage.single.value) != Stage.single.value]
    keys = [canonical({k: p.get(k) for k in ("lrs", "tune_seeds")}) for p in protocols]
    found = Counter(keys)
    if not found:
        return None
    if len(found) > 1:
        log.warning("the runs carry %d different protocols; the report follows the commonest", len(found))
    common = found.most_common(1)[0][0]
    ours = [p for p, key in zip(protocols, keys) if key == common]
    seed_lists = sorted({tuple(p.get("seeds") or ()) for p in ours})
    # How far grids widen: the most any run was made under (a finished run keeps the setting it ran with, so
    # the tuning runs of a study later run with a larger protocol.widen still say the smaller); runs from
    # before the setting existed were made without widening.
    # The schedule the rates were tuned at: stage patience doubles it (protocol.tune_patience)
    tuned_at = Counter(schedule_of(r["config"]) for r in results
                       if (r["config"].get("protocol") or {}).get("stage") == Stage.tune.value)
    return json.loads(common) | {
        "seeds": sorted(set().union(*seed_lists)), "seed_lists": [list(s) for s in seed_lists],
        "widen": max(p.get("widen", 0) for p in protocols),
        "tune_spec_augment": any(p.get("tune_spec_augment") for p in protocols),
        "tune_patience": max(p.get("tune_patience", 0) for p in protocols),
        "schedule": list(tuned_at.most_common(1)[0][0]) if tuned_at else None}


def thread_count(result: dict) -> str:
    """The torch threads a run trained with: recorded since session 8; before, train.threads, where 0 (torch's
    default, all cores) was not recorded as a number, so such a run counts apart from every recorded count."""
    given = result.get("threads") or result.get("config", {}).get("train", {}).get("threads")
    return str(given) if given else "torch's default (not recorded)"


def distinct(results: list[dict], key: str) -> str:
    values = sorted({str(r[key]) for r in results if r.get(key) is not None})
    return ", ".join(values) or "unknown"


# ----------------------------------------------------------------------------------------------------
# rows


def varying(runs: dict) -> list[str]:
    """The settings (not the seed, rnn, bn or impl) whose values differ between rows: depth, then the
    rate, then the rest by name."""
    values = defaultdict(set)
    keys = set().union(*(group[0]["settings"] for group in runs.values()))
    for group in runs.values():
        for k in keys:
            values[k].add(canonical(group[0]["settings"].get(k)))
    out = [k for k in keys - {SEED, RNN, BN, IMPL} if len(values[k]) > 1]
    return sorted(out, key=lambda k: (k != DEPTH, k != LR, k))


def short(key: str, keys: list[str]) -> str:
    """A setting's last name (lr, hidden_size), or its whole name when two settings share the last."""
    last = key.rsplit(".", 1)[-1]
    return last if sum(k.rsplit(".", 1)[-1] == last for k in keys) == 1 else key


def value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def describe(s: dict, keys: list[str], columns: list[str], bn: bool = True) -> str:
    """rnn-bn[-impl][-L<layers>] plus key=value for each other setting in keys: a row's, variant's or
    group's name."""
    name = s[RNN] + (f"-{placement(s)}" if bn else "")
    if DEPTH in keys:
        name += f"-L{s.get(DEPTH)}"
    return " ".join([name] + [shown_setting(k, s.get(k), columns) for k in keys if k != DEPTH])


def shown_setting(key: str, v, columns: list[str]) -> str:
    """key=value in a row's name: spec_augment=on|off for train.spec_augment.enabled."""
    return f"{'spec_augment' if key == AUGMENT else short(key, columns)}={setting_value(key, v)}"


def column_name(key: str, columns: list[str]) -> str:
    return "SpecAugment" if key == AUGMENT else short(key, columns)


def setting_value(key: str, v) -> str:
    return ("off" if v is False else "on") if key == AUGMENT else value(v)


def rank(order: list, x) -> tuple:
    return (order.index(x), "") if x in order else (len(order), str(x))


def ordered(v) -> tuple:
    """A sort key for any setting's value: numbers by value, before anything else by its JSON."""
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, canonical(v))


def make_row(runs: list[dict], columns: list[str], protocol: dict | None, choice: dict) -> dict:
    s = runs[0]["settings"]
    impl = s.get(IMPL, Impl.fused.value)
    # Under a protocol each variant has its own rate (and SpecAugment, where tuned): they name a row, not a group or
    # a variant.
    per_variant = [k for k in columns if not (protocol and k in tuned(protocol))]
    where, row_role = placement(s), role(runs[0]["result"]["config"], protocol, choice)
    # A verdict holds the protocol's seeds only: not a stray single run (seed 0) that happens to share the rate
    ours = [r for r in runs if not (protocol and row_role == "verdict" and r["seed"] not in protocol["seeds"])]
    finished = [r for r in ours if r["status"] == "finished"]
    # Seeds that diverged have no test WER, but they count: against the row's n in the tables, and as never
    # reaching the speed threshold after the epochs they trained, unless they reached it before.
    trained = [r for r in ours if r["status"] in ("finished", "diverged")]
    row = {"label": describe(s, columns, columns), "variant": describe(s, per_variant, columns),
           "group": describe(s, per_variant, columns, bn=False),
           "depth_free": describe(s, [k for k in per_variant if k != DEPTH], columns),
           "family": describe(s, [k for k in per_variant if k != DEPTH], columns, bn=False),  # group less depth
           "placement": where,
           # within its group: the placement (and the rate of a variant still tuning, whose rows are all plotted)
           "name": where + (f" lr={value(s.get(LR))}" + " SpecAugment off" * (s.get(AUGMENT) is False)
                            if row_role == "pending" else ""),
           "rnn": s[RNN], "bn": s[BN], "impl": impl, "num_layers": s.get(DEPTH), "lr": s.get(LR),
           "settings": {k: s.get(k) for k in columns}, "role": row_role,
           "n": len(finished), "seeds": [r["seed"] for r in finished], "diverged": len(trained) - len(finished),
           "test_wer_by_seed": [r["result"].get("test_wer") for r in finished],
           # reached the epoch cap or the rate's floor while validation was still improving: maybe not converged
           "capped": sum(r["improving_at_cap"] for r in finished),
           # against the group's `none` (compare fills them in): the results table's last column
           "dwer": math.nan, "dwer_lo": math.nan, "dwer_hi": math.nan, "p": None, "p_holm": None, "significant": False,
           "dwer_capped": False,
           "_runs": runs, "_finished": finished, "_trained": trained,
           "_sort": (rank(RNN_ORDER, s[RNN]), [ordered(s.get(k)) for k in per_variant], rank(BN_ORDER, s[BN]),
                     rank(IMPL_ORDER, impl), ordered(s.get(LR)))}
    for name in METRICS:
        row[name], row[f"{name}_std"] = mean_std([r["result"].get(name) for r in finished])
    row["epochs_trained"], row["epochs_trained_std"] = mean_std([len(r["epochs"]) for r in finished])
    row["params"] = mean_std([r["result"].get("params") for r in finished])[0]  # the same for every seed
    return row


def role(config: dict, protocol: dict | None, choice: dict) -> str:
    """verdict: in the results table; tuning: at a setting its variant did not choose; pending: its variant's
    tuning is not complete; off_grid: outside its variant's search (a rate outside protocol.lrs, widened; SpecAugment
    off or a doubled schedule away from the chosen rate; a schedule no doubling of the one the rates were tuned at).
    The search is by coordinates: rates at the base schedule with SpecAugment on, then SpecAugment off at the chosen
    rate, then the schedule doubled at both choices (batchrnn.study.protocol.choose_lrs)."""
    if protocol is None:
        return "verdict"
    entry = choice.get(variant_key(config))
    step = patience_step(config, tuple(protocol["schedule"] or ())) if protocol.get("tune_patience") else 0
    if entry is None or step is None or config["train"]["lr"] not in entry["grid"]:
        return "off_grid"
    on = augment_on(config) if protocol.get("tune_spec_augment") else None
    if entry["lr"] is None:
        return "pending"
    if config["train"]["lr"] != entry["lr"]:
        return "tuning" if on is not False and step == 0 else "off_grid"
    if on is not None:  # stage augment: off is tried at the chosen rate only
        if entry["augment"] is None:
            return "pending"
        if on != entry["augment"]:
            return "tuning" if step == 0 else "off_grid"
    if protocol.get("tune_patience"):  # stage patience: doublings at the chosen rate and SpecAugment only
        if entry["patience"] is None:
            return "pending" if step in entry["patience_grid"] or step == 0 else "off_grid"
        return "verdict" if step == entry["patience"] else "tuning" if step in entry["patience_grid"] else "off_grid"
    return "verdict"


def tuned(protocol: dict) -> tuple[str, ...]:
    """The settings the protocol chooses per variant: the rate, SpecAugment where protocol.tune_spec_augment, the
    schedule's waits and cap where protocol.tune_patience."""
    return (LR,) + (AUGMENT,) * bool(protocol.get("tune_spec_augment")) + SCHEDULE * bool(protocol.get("tune_patience"))


def training_time(rows: list[dict]) -> dict:
    """What the study cost: hours of training (the sum of the epochs' times: validation, testing and start-up
    are not timed) of every run read (duplicates left out, unfinished and diverged runs in), with the share in
    the verdict's rows; runs taken from another study (protocol.reuse_from) apart, as they were not trained here."""
    out = {"hours": 0.0, "runs": 0, "verdict_hours": 0.0, "reused_hours": 0.0, "reused_runs": 0}
    for row in rows:
        for run in row["_runs"]:
            hours = sum(e.get("epoch_time_s") or 0.0 for e in run["epochs"]) / 3600
            if run["result"].get("reused_from"):
                out["reused_hours"] += hours
                out["reused_runs"] += 1
                continue
            out["hours"] += hours
            out["runs"] += 1
            out["verdict_hours"] += hours * (row["role"] == "verdict")
    return out


def tuning_table(rows: list[dict], choice: dict, protocol: dict | None) -> list[dict]:
    if protocol is None:
        return []
    labels = {}
    for row in rows:  # sorted, so the variants come in the results table's order
        labels.setdefault(variant_key(row["_runs"][0]["result"]["config"]), row["variant"])
    return [{"label": label, "lr": choice[key]["lr"], "missing": choice[key]["missing"], "grid": choice[key]["grid"],
             "by_lr": {value(lr): wer for lr, wer in choice[key]["by_lr"].items()},
             **{k: choice[key][k] for k in ("augment", "by_augment", "augment_missing", "patience", "patience_grid",
                                            "by_patience", "patience_missing") if k in choice[key]}}
            for key, label in labels.items()]


def time_drift(rows: list[dict]) -> list[dict]:
    """The rows whose finished seeds' median epoch times on one machine differ by more than DRIFT (largest
    spread first): the same work at different speeds, so the machine's speed changed between the runs, and
    time ratios between rows measure when a run ran as well as the variant. Only a setting's own seeds can
    show it: seeds that all ran in one slow spell agree, and are not named."""
    drifted = []
    for row in rows:
        by_machine = defaultdict(list)  # seeds run on different machines differ for another reason
        for r in row["_finished"]:
            if t := r["result"].get("epoch_time_s"):
                by_machine[r["result"].get("machine")].append(t)
        for times in by_machine.values():
            if len(times) > 1 and min(times) >= DRIFT_MIN_S and max(times) > DRIFT * min(times):
                drifted.append({"label": row["label"], "min_s": min(times), "max_s": max(times),
                                "ratio": max(times) / min(times)})
    return sorted(drifted, key=lambda d: -d["ratio"])


def add_ratios(group: list[dict]) -> None:
    """Time and memory over the `none` row of the group: the cost of a placement, measured in this sweep."""
    none = baseline(group, NONE)
    for row in group:
        for name, ratio in (("epoch_time_s", "time_ratio"), ("peak_mem_mb", "mem_ratio")):
            row[ratio] = row[name] / none[name] if none and none[name] else math.nan


def baseline(group: list[dict], bn: str) -> dict | None:
    return next((r for r in group if r["bn"] == bn and r["impl"] == Impl.fused.value), None)


# Validation WER at which a CTC model has left its blank phase (emitting blanks only scores 100%): the early
# speed, which the group's threshold, set near the variants' final quality, may not tell apart
LEFT_BLANK = 0.9


def add_speed(group: list[dict]) -> None:
    """Speed of convergence: epochs and training seconds until validation WER first reaches the group's
    threshold, the highest of its rows' median best validation WER (median over seeds, so one seed that
    failed to train does not loosen the threshold for the whole group; at least half of every row's
    seeds reach it). A seed that never reaches it (or diverged first) is censored: it counts with the
    epochs and seconds it trained, a lower bound, so the row's mean is one too (`censored` > 0) and can
    lose a comparison but never win it (`faster`). Also the epochs until it first reaches LEFT_BLANK
    (`epochs_to_words`, censored alike: `words_censored`), descriptive only."""
    bests = [statistics.median(b) for r in group
             if (b := [run["result"]["best_val_wer"] for run in r["_finished"]
                       if run["result"].get("best_val_wer") is not None])]
    threshold = max(bests) if bests else math.nan
    for row in group:
        times, reached = reach(row["_trained"] if bests else [], threshold)
        row["threshold"], row["trained"], row["reached"], row["censored"] = (threshold, len(times), reached,
                                                                             len(times) - reached)
        row["epochs_to"], row["epochs_to_std"] = mean_std([e for e, _ in times])
        row["seconds_to"], row["seconds_to_std"] = mean_std([s for _, s in times])
        words, reached = reach(row["_trained"], LEFT_BLANK)
        row["words_censored"] = len(words) - reached
        row["epochs_to_words"], row["epochs_to_words_std"] = mean_std([e for e, _ in words])


def reach(runs: list[dict], threshold: float) -> tuple[list[tuple[int, float]], int]:
    """Per run, (epoch, training seconds) at which validation WER first reached threshold, or, censored, the
    epochs and seconds it trained; and how many of the runs reached it."""
    times, reached = [], 0
    for run in runs:
        at = first_reach(run["epochs"], threshold)
        reached += at is not None
        times.append(at or (len(run["epochs"]), sum(e.get("epoch_time_s") or 0.0 for e in run["epochs"])))
    return times, reached


# ----------------------------------------------------------------------------------------------------
# head to head


def compare(groups: dict, decoded: str = "") -> tuple[list[dict], list[str]]:
    """Within each group, every variant against `none` and `seqwise` against every other, and each variant of
    BUILDS_ON against the one it builds on, by the paired two-level bootstrap; Holm's correction over the whole
    family. Each row gets its comparison with `none`. Also, per group with more than one row, the references
    it has no finished row of. decoded: "" for greedy's test outputs, LM for those decoded with the word LM (the
    row's keys then take that prefix: lm_dwer ...)."""
    out, vs_none, unpaired = [], [], []
    for group, members in groups.items():
        seen = set()

        def add(a: dict, b: dict) -> bool:
            if a is b or (pair := frozenset((a["label"], b["label"]))) in seen:
                return False
            seen.add(pair)
            out.append(comparison(a, b, decoded))
            return True

        for reference in REFERENCES:
            b = baseline(members, reference)
            if b is None and len(members) > 1:
                unpaired.append(f"{group}: no finished `{reference}` row, so no comparison with it")
            for a in members if b else []:
                if add(a, b) and reference == NONE:
                    vs_none.append((a, out[-1]))
        for a in members:
            if a["bn"] in BUILDS_ON and (b := baseline(members, BUILDS_ON[a["bn"]])) is not None:
                add(a, b)
    tested = [c for c in out if c["p"] is not None]
    for c, p in zip(tested, holm([c["p"] for c in tested])):
        c["p_holm"], c["significant"] = p, p < ALPHA
        c["quality_winner"] = (c["a"] if c["dwer"] < 0 else c["b"]) if c["significant"] else None
        c["split"] = bool(c["quality_winner"] and c["speed_winner"] and c["quality_winner"] != c["speed_winner"])
    for row, c in vs_none:
        row.update({decoded + k: c[k] for k in ("dwer", "dwer_lo", "dwer_hi", "p", "p_holm", "significant")})
        row[decoded + "dwer_capped"] = any(c["capped"].values())
    return out, unpaired


def comparison(a: dict, b: dict, decoded: str = "") -> dict:
    d = paired_bootstrap(errors_of(a, decoded), errors_of(b, decoded))
    return {"group": a["group"], "a": a["label"], "b": b["label"], "a_name": a["name"], "b_name": b["name"],
            "dwer": d.dwer if d else math.nan, "dwer_lo": d.lo if d else math.nan, "dwer_hi": d.hi if d else math.nan,
            "p": d.p if d else None, "p_holm": None, "significant": False, "quality_winner": None,
            "speed_winner": faster(a, b), "speed_censored": bool(a["censored"] or b["censored"]), "split": False,
            "capped": {a["label"]: a["capped"], b["label"]: b["capped"]}, "n": {a["label"]: a["n"], b["label"]: b["n"]}}


def errors_of(row: dict, decoded: str = "") -> list[dict]:
    """Each finished seed's per-utterance word errors (decoded=LM: with the word LM), computed once per run."""
    for run in row["_finished"]:
        if decoded + "errors" not in run:
            run[decoded + "errors"] = utterance_errors(run["result"]["lm"] if decoded else run["result"])
    return [run[decoded + "errors"] for run in row["_finished"]]


def faster(a: dict, b: dict) -> str | None:
    """The label of the row that reaches the threshold at least half an epoch sooner on average (descriptive,
    not a test); None for a tie, and when the sooner mean is a lower bound (a seed of it never reached the
    threshold), which the other could still beat."""
    if math.isnan(a["epochs_to"]) or math.isnan(b["epochs_to"]) or abs(a["epochs_to"] - b["epochs_to"]) < 0.5:
        return None
    sooner = a if a["epochs_to"] < b["epochs_to"] else b
    return None if sooner["censored"] else sooner["label"]


# ----------------------------------------------------------------------------------------------------
# decoded with the word LM

LM = "lm_"  # the prefix of a row's figures under LM decoding, and compare()'s `decoded`


def lm_at_edge(lm: dict) -> list[str]:
    """The edges of its grid that a run's LM choice lies on: results.json's own record, or, for a run decoded before
    the grid widened (decode.widen), the edges of the grid it was decoded on."""
    if "at_edge" in lm:
        return lm["at_edge"]
    from batchrnn.decoding.tuning import AXES, edges

    axes = tuple(sorted({p[name] for p in lm["grid"]}) for name in AXES)
    return [f"{AXES[axis]} {edge}" for axis, edge, _ in edges(lm, axes)]


def lm_family(rows: list[dict]) -> dict | None:
    """The verdict decoded with the word LM: each row's LM test WER and CER, greedy's beside them, and every seed's
    chosen LM weight and word score; the same comparisons as greedy's over the rows whose every finished seed was
    decoded, as a family of their own (Holm over it alone, never mixed with greedy's). None when no run was."""
    if not any("lm" in run["result"] for row in rows for run in row["_finished"]):
        return None
    groups, partial, models = defaultdict(list), [], set()
    for row in rows:
        decoded = [run["result"]["lm"] for run in row["_finished"] if "lm" in run["result"]]
        for name in ("test_wer", "test_cer"):
            row[LM + name], row[f"{LM}{name}_std"] = mean_std([lm[name] for lm in decoded])
        row[LM + "n"] = len(decoded)
        # against `none` with the LM (compare fills them in for the rows of the family), as make_row's for greedy
        row.update({LM + "dwer": math.nan, LM + "dwer_lo": math.nan, LM + "dwer_hi": math.nan, LM + "p": None,
                    LM + "p_holm": None, LM + "significant": False, LM + "dwer_capped": False})
        row[LM + "chosen"] = [{"seed": run["seed"], "at_edge": lm_at_edge(run["result"]["lm"]),
                               **{k: run["result"]["lm"][k] for k in ("lm_weight", "word_score", "val_wer",
                                                                       "beam_size")}}
                              for run in row["_finished"] if "lm" in run["result"]]
        # the grid as given (widened runs decode more points, on the same rule)
        models |= {f"{lm['lm']} (sha256 {lm['lm_sha256'][:16]}, {'built here' if lm['lm_built'] else 'given'}, "
                   f"beam {lm['beam_size']}, grid {len(lm.get('lm_weights') or ())} x "
                   f"{len(lm.get('word_scores') or ())}, widened up to {lm.get('widen', 0)} times an edge)"
                   for lm in decoded}
        if decoded and len(decoded) == row["n"]:
            groups[row["group"]].append(row)
        elif row["n"]:
            partial.append(f"{row['label']}: {len(decoded)} of {row['n']} seeds decoded")
    comparisons, unpaired = compare(groups, LM)
    return {"models": sorted(models), "rows": [r["label"] for g in groups.values() for r in g], "partial": partial,
            "comparisons": comparisons, "unpaired": unpaired}
