"""Which learning rate (and, where tuned, SpecAugment setting and schedule patience) each variant gets: the fair
protocol's rule over a study's tuning runs (stage tune, its widening past an edge, stage augment, stage patience,
and stage final). A run's identity is batchrnn.training.identity's.
"""
import math
from collections import defaultdict

from batchrnn.training.identity import AUGMENT, LR, SCHEDULE, augment_on, settings, variant_key, variant_label
from batchrnn.training.rundir import read_study


def val_wer_for_choice(result: dict) -> float:
    """A finished run's best validation WER; a diverged run's is infinite (that rate lost); None while running."""
    if result.get("status") == "diverged":
        return math.inf
    return result.get("best_val_wer") if result.get("status") == "finished" else None


def rate(x: float) -> float:
    """A learning rate as the grid and the run folders write it (6 significant digits): 4e-3 * 2 is 0.008."""
    return float(f"{x:.6g}")


def can_widen(lrs: list[float]) -> bool:
    """Only a grid of three rates or more widens: with two, both are edges and no best lies inside."""
    return len(lrs) >= 3


def variant_title(config: dict) -> str:
    """rnn-bn[-cells] (L<layers>): a variant as the protocol's messages name it."""
    return f"{variant_label(settings(config))} (L{config['model']['num_layers']})"


def variant_grid(lrs: list[float], by_lr: dict[float, float | None], widen: int) -> list[float]:
    """The rates one variant is tuned at: `lrs`, widened by one rate past an edge (in the grid's own ratio)
    while its best rate (by_lr: mean best validation WER or None) is the lowest or highest one, at most
    `widen` times (can_widen)."""
    grid = sorted(lrs)
    for _ in range(widen if can_widen(lrs) else 0):
        if any(by_lr.get(lr) is None for lr in grid):
            break  # not all tuned yet: nothing to widen from
        best = min(grid, key=lambda lr: (by_lr[lr], lr))
        if by_lr[best] == math.inf:
            break  # every rate diverged
        if best == grid[-1]:
            grid.append(rate(grid[-1] * grid[-1] / grid[-2]))
        elif best == grid[0]:
            grid.insert(0, rate(grid[0] * grid[0] / grid[1]))
        else:
            break
    return grid


def schedule_of(config: dict) -> tuple[int, ...]:
    """(train.plateau_wait, train.patience, train.epochs): the schedule's patience, as stage patience doubles it."""
    t = config["train"]
    return tuple(t.get(key.split(".")[1]) for key in SCHEDULE)


def doubled(base: tuple[int, ...], step: int) -> tuple[int, ...]:
    """The schedule `step` doublings more patient than `base` (the cap with the waits: as far out of reach)."""
    return tuple(v * 2 ** step for v in base)


def patience_step(config: dict, base: tuple[int, ...] | None) -> int | None:
    """How many doublings of `base` (the schedule the rate was tuned at) this run's schedule is; None for one
    that is no doubling of it (outside the patience stage's search)."""
    have = schedule_of(config)
    return next((k for k in range(16) if base and doubled(base, k) == have), None)


def patience_label(base: tuple[int, ...], step: int) -> str:
    """plateau_wait/patience, cap: "6/12, cap 300", as the report's tuning table names a schedule."""
    wait, patience, cap = doubled(base, step)
    return f"{wait}/{patience}, cap {cap}"


def choose_lrs(results: list[dict], lrs: list[float], tune_seeds: list[int], widen: int = 0,
               tune_augment: bool = False, tune_patience: int = 0,
               base: tuple[int, ...] | None = None) -> dict[str, dict]:
    """{variant key: {"lr": chosen rate or None, "grid": its rates, "by_lr": {rate: mean best val WER or
    None}, "missing": [(rate, seed), ...]}} for every variant among `results` (results.json dicts). The
    rule: the rate of the variant's grid (`lrs`, widened past the edge where its best lies: variant_grid)
    with the lowest best validation WER averaged over `tune_seeds`; ties go to the smaller rate. Nothing
    is chosen while a tuning run is missing or unfinished, nor when every rate diverged.

    tune_augment (protocol.tune_spec_augment): the rates are tuned with SpecAugment on, and each entry also has
    "augment" (True: on, False: off, None: not chosen yet), "by_augment" {"on": val WER at the chosen rate,
    "off": the same with SpecAugment off, or None} and "augment_missing" (the tuning seeds without a finished
    run off at the chosen rate). Off is kept only where it is strictly better.

    tune_patience (protocol.tune_patience), with base (schedule_of the runs the rate was tuned at): after the rate
    and SpecAugment, the schedule doubled (doubled) at those settings; each entry also has "patience" (the chosen
    number of doublings, 0 for base; None: not chosen yet), "patience_grid" (the doublings tried: 0 and 1, then
    one more each time the most patient so far is strictly best, up to tune_patience), "by_patience" {doublings:
    mean best val WER or None} and "patience_missing" [(doublings, seed), ...]. Rate and SpecAugment are chosen
    at base, so the search is by coordinates."""
    found = defaultdict(dict)  # variant -> {(lr, SpecAugment on or None, doublings, seed): val WER}
    for r in results:
        config, value = r["config"], val_wer_for_choice(r)
        step = patience_step(config, base) if tune_patience else 0
        if step is None:
            continue  # a schedule outside the search: it plays no part in any choice
        runs = found[variant_key(config)]
        key = config["train"]["lr"], augment_on(config) if tune_augment else None, step, config["seed"]
        old = runs.get(key)  # a second folder of the same run (hand-made): finished beats diverged beats running
        if old is None or (old == math.inf and value is not None):
            runs[key] = value
    on = True if tune_augment else None  # the rates are tuned with SpecAugment on
    choice = {}
    for variant, runs in found.items():
        means = {lr: mean_of([runs.get((lr, on, 0, seed)) for seed in tune_seeds])
                 for lr in set(lrs) | {lr for lr, _, _, _ in runs}}
        grid = variant_grid(lrs, means, widen)
        missing = [(lr, seed) for lr in grid for seed in tune_seeds if runs.get((lr, on, 0, seed)) is None]
        by_lr = {lr: means.get(lr) for lr in grid}
        chosen = None if missing else min(grid, key=lambda lr: (by_lr[lr], lr))
        if chosen is not None and by_lr[chosen] == math.inf:
            chosen = None  # every rate diverged: there is no rate to train the seeds at
        choice[variant] = {"lr": chosen, "grid": grid, "by_lr": by_lr, "missing": missing}
        if tune_augment:
            off = [runs.get((chosen, False, 0, seed)) for seed in tune_seeds] if chosen is not None else []
            by_augment = {"on": by_lr[chosen] if chosen is not None else None, "off": mean_of(off)}
            augment = None if chosen is None or by_augment["off"] is None else not by_augment["off"] < by_augment["on"]
            choice[variant] |= {"augment": augment, "by_augment": by_augment,
                                "augment_missing": [seed for seed, v in zip(tune_seeds, off) if v is None]}
        if tune_patience:
            settled = chosen is not None and (not tune_augment or choice[variant]["augment"] is not None)
            at = (chosen, choice[variant]["augment"] if tune_augment else None)
            at_chosen = {(k, seed): v for (lr, aug, k, seed), v in runs.items() if (lr, aug) == at}
            choice[variant] |= patience_choice(at_chosen if settled else None, tune_seeds, tune_patience)
    return choice


def patience_choice(runs: dict | None, tune_seeds: list[int], tune_patience: int) -> dict:
    """choose_lrs's patience fields from {(doublings, seed): val WER} at the chosen rate and SpecAugment (None:
    those not chosen yet). The first doubling is always tried; another only while the most patient so far is
    strictly best (ties: the shorter schedule), as the rate grid widens past its edge."""
    if runs is None:
        return {"patience": None, "patience_grid": [], "by_patience": {}, "patience_missing": []}
    grid = [0, 1]
    while True:
        means = {k: mean_of([runs.get((k, seed)) for seed in tune_seeds]) for k in grid}
        if any(v is None for v in means.values()):
            break
        best = min(grid, key=lambda k: (means[k], k))
        if best != grid[-1] or len(grid) > tune_patience or means[best] == math.inf:
            break
        grid.append(grid[-1] + 1)
    missing = [(k, seed) for k in grid for seed in tune_seeds if runs.get((k, seed)) is None]
    chosen = None if missing else min(grid, key=lambda k: (means[k], k))
    return {"patience": chosen, "patience_grid": grid, "by_patience": means, "patience_missing": missing}


def mean_of(values: list) -> float | None:
    """The mean of the tuning seeds' best validation WERs; None while any is missing or unfinished (or none). Rounded
    to 12 significant digits, so that means of equal error counts tie as the rules say (ties to the smaller rate, to
    SpecAugment on, to the shorter schedule), where float sums of per-seed ratios can differ in the last bit: 120 and
    127 errors of 514 came out above 121 and 126."""
    return None if not values or None in values else float(f"{sum(values) / len(values):.12g}")


def protocol_choice(results: list[dict], p: dict, base: tuple[int, ...] | None = None) -> dict[str, dict]:
    """choose_lrs under a study's protocol settings (the `protocol` section of a run's config); base: the schedule
    the rates are tuned at (schedule_of the study's preset), where protocol.tune_patience is set."""
    return choose_lrs(results, p["lrs"], p["tune_seeds"], p.get("widen", 0), bool(p.get("tune_spec_augment")),
                      p.get("tune_patience", 0), base)


class ProtocolError(RuntimeError):
    """A protocol stage that cannot run yet; the message says which runs are missing and how to make them."""


def tuning_choice(study_dir, config: dict) -> dict | None:
    """choose_lrs's entry for this run's variant, from the tuning runs in study_dir (None: it has none)."""
    p = config["protocol"]  # a non-empty grid: config.validate refuses stages tune, widen, final without one
    results, _ = read_study(study_dir)
    tuning = [r for r in results if r["config"]["seed"] in p["tune_seeds"]]
    # config is a job's as composed, before its stage's settings: its schedule is the preset's, the rates' own
    return protocol_choice(tuning, p, schedule_of(config)).get(variant_key(config))


def widened_lr(study_dir, config: dict) -> float | None:
    """The rate past the grid's edge that this run's variant and seed are to be tuned at next (stage
    widen), or None when it needs none: its best rate lies inside its grid, every rate diverged, or the
    grid has widened protocol.widen times."""
    choice = tuning_choice(study_dir, config)
    base = set(config["protocol"]["lrs"])
    if choice is None or any(lr in base for lr, _ in choice["missing"]):
        raise ProtocolError(f"{study_dir}: the tuning stage of {variant_title(config)} is not "
                            "complete, so its grid cannot widen yet; run the tuning stage first (python -m "
                            "batchrnn.study.scheduler runs every stage)")
    return next((lr for lr, seed in choice["missing"] if seed == config["seed"]), None)


def tuned_lr(study_dir, config: dict) -> float:
    """The learning rate the tuning stage chose for this run's variant, from the runs in study_dir."""
    p = config["protocol"]
    choice = tuning_choice(study_dir, config)
    if choice and not choice["missing"] and choice["lr"] is None:
        raise ProtocolError(f"{study_dir}: every rate of protocol.lrs {p['lrs']} diverged for this variant; add lower "
                            "rates to protocol.lrs and run the tuning stage again")
    if choice is None or choice["lr"] is None:
        missing = choice["missing"] if choice else [(lr, s) for lr in p["lrs"] for s in p["tune_seeds"]]
        raise ProtocolError(
            f"{study_dir}: the tuning stage of {variant_title(config)} is not complete: missing or "
            f"unfinished (lr, seed) {missing}; run the tuning stages first (python -m batchrnn.study runs them all: "
            "tune, then widen for a rate past the grid's edge)")
    return choice["lr"]


def tuned_augment(study_dir, config: dict) -> bool:
    """Whether this run's variant keeps SpecAugment on, as stage augment chose (protocol.tune_spec_augment)."""
    choice = tuning_choice(study_dir, config)
    if choice is None or choice.get("augment") is None:
        seeds = choice["augment_missing"] if choice else config["protocol"]["tune_seeds"]
        raise ProtocolError(
            f"{study_dir}: stage augment of {variant_title(config)} is not complete: missing or unfinished "
            f"seeds {seeds} with SpecAugment off at its chosen rate; run the tuning stages first (python -m "
            "batchrnn.study runs them all: tune, widen, augment)")
    return choice["augment"]


def patience_entry(study_dir, config: dict) -> dict:
    """tuning_choice's entry once the rate (and SpecAugment, where tuned) are chosen: what stage patience needs."""
    chosen = {LR: tuned_lr(study_dir, config)}
    if config["protocol"]["tune_spec_augment"]:
        chosen[AUGMENT] = tuned_augment(study_dir, config)
    return tuning_choice(study_dir, config) | {"chosen": chosen}


def patient_step(study_dir, config: dict) -> int | None:
    """The doublings of the schedule this run's variant and seed are to be tried at next (stage patience), or None
    when it needs none: the shorter schedule won, or the schedule has doubled protocol.tune_patience times."""
    entry = patience_entry(study_dir, config)
    return next((k for k, seed in entry["patience_missing"] if seed == config["seed"]), None)


def tuned_patience(study_dir, config: dict) -> int:
    """How many doublings of the schedule stage patience chose for this run's variant (protocol.tune_patience)."""
    entry = patience_entry(study_dir, config)
    if entry["patience"] is None:
        raise ProtocolError(
            f"{study_dir}: stage patience of {variant_title(config)} is not complete: missing or unfinished "
            f"(doublings, seed) {entry['patience_missing']} at its chosen settings; run the tuning stages first "
            "(python -m batchrnn.study runs them all: tune, widen, augment, patience)")
    return entry["patience"]


def schedule_settings(config: dict, step: int) -> dict:
    """{train.plateau_wait, train.patience, train.epochs: values} `step` doublings past the config's own."""
    return dict(zip(SCHEDULE, doubled(schedule_of(config), step)))


def stage_settings(study_dir, config: dict) -> dict | None:
    """What a run of its protocol.stage trains with, as {setting: value}: train.lr as given (no stage, or tune);
    the rate the tuning chose, with SpecAugment off (augment); the next rate past the grid's edge (widen; None
    when there is nothing to widen); the chosen rate and SpecAugment with the schedule doubled once more
    (patience; None when nothing more patient is to be tried); the tuning's choices of all (final; SpecAugment and
    the schedule only where protocol.tune_spec_augment and protocol.tune_patience are set). config: the job's, as
    composed (its schedule is the preset's). Raises ProtocolError while the tuning it needs is missing."""
    stage, p = config["protocol"]["stage"], config["protocol"]
    if stage == "final":
        chosen = {LR: tuned_lr(study_dir, config)}
        if p["tune_spec_augment"]:
            chosen[AUGMENT] = tuned_augment(study_dir, config)
        return chosen | (schedule_settings(config, tuned_patience(study_dir, config)) if p["tune_patience"] else {})
    if stage == "augment":
        return {LR: tuned_lr(study_dir, config), AUGMENT: False}
    if stage == "widen":
        lr = widened_lr(study_dir, config)
        return None if lr is None else {LR: lr}
    if stage == "patience":
        step = patient_step(study_dir, config)
        return None if step is None else patience_entry(study_dir, config)["chosen"] | schedule_settings(config, step)
    return {LR: config["train"]["lr"]}


def nothing_to_train(config: dict) -> str:
    """The line of a stage job that needs no run (stage_settings gave None)."""
    if config["protocol"]["stage"] == "patience":
        return (f"{variant_title(config)}, seed {config['seed']}: nothing more patient to try (the shorter schedule "
                "won, or the schedule has doubled protocol.tune_patience times)")
    return (f"{variant_title(config)}, seed {config['seed']}: nothing to widen (its best rate lies inside its grid, "
            "every rate diverged, or the grid has widened protocol.widen times)")
