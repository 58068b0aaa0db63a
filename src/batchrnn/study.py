"""A study under the fair protocol, in one resumable command: tune each variant's rate, then its seeds.

    python -m batchrnn.study experiment=an4_cpu model.rnn=gru,lstm model.bn=none,input,seqwise [--wandb]

Stage tune sweeps every variant over protocol.lrs with protocol.tune_seeds; stage widen (protocol.widen
times) tunes each variant whose best rate is an edge of its grid at one rate past it; stage final runs
protocol.seeds at the rate each variant's validation WER chose (batchrnn.protocol.choose_lrs); then the
report. Finished runs are skipped, so running it again resumes; a tuning run at the chosen rate is that
seed's final run.
"""
import argparse
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchrnn.config import ConfigError, register_configs, validate, with_device_preset
from batchrnn.errors import DIVERGED, one_line, worst
from batchrnn.protocol import can_widen

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "src" / "run.py"), "-m"]


def protocol_of(overrides: list[str]):
    """The composed protocol section and study folder, from the overrides that are not sweeps."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            validate(compose(config_name="config", overrides=fixed))
            cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ConfigError) as e:  # before any run: one line, as run.py
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    return cfg.protocol, Path(cfg.hydra.sweep.dir)


def as_list(values) -> str:
    return ",".join(str(v) for v in values)


def stages(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(name, the run.py -m arguments) of each stage, in order."""
    p, _ = protocol_of(overrides)
    if not p.lrs:
        return [("runs", [*overrides, f"seed={as_list(p.seeds)}"])]
    widen = [(f"widen {i}" if p.widen > 1 else "widen", [*overrides, "protocol.stage=widen", f"seed={as_list(p.tune_seeds)}"])
             for i in range(1, p.widen + 1)] if can_widen(p.lrs) else []
    return [("tune", [*overrides, "protocol.stage=tune", f"train.lr={as_list(p.lrs)}", f"seed={as_list(p.tune_seeds)}"]),
            *widen, ("final", [*overrides, "protocol.stage=final", f"seed={as_list(p.seeds)}"])]


def exit_status(code: int) -> int:
    """A child's return code as a shell would show it: killed by signal N (-N) is 128 + N."""
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides and sweeps, as for src/run.py -m")
    parser.add_argument("--wandb", action="store_true", help="log the report to W&B as well")
    args = parser.parse_args(argv)
    args.overrides = with_device_preset(args.overrides)
    _, study_dir = protocol_of(args.overrides)
    status = 0
    plan = stages(args.overrides)
    for i, (name, stage) in enumerate(plan):
        print(f"study: stage {name}: src/run.py -m {' '.join(stage)}", flush=True)
        code = exit_status(subprocess.run([*RUN, *stage]).returncode)
        # 3: some runs diverged, which the rate choice counts as lost. Anything else stops before the final
        # stage; after it (a variant with no rate to take, a damaged run folder), the report still shows
        # what finished, and the exit status says that something did not.
        if code not in (0, DIVERGED) and i < len(plan) - 1:
            sys.exit(code)
        status = worst(status, code)
    report = [sys.executable, "-m", "batchrnn.report", str(study_dir)] + ["--wandb"] * args.wandb
    status = worst(status, exit_status(subprocess.run(report).returncode))
    print(f"study: report in {study_dir / 'report.md'}")
    sys.exit(status)


if __name__ == "__main__":
    main()
