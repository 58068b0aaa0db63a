"""A run's folder: results.json (its state), checkpoint.pt (to resume), best.pt (the model), run.log.

Every file is replaced whole (storage.atomic_write), so a killed run leaves the last complete epoch.
A folder belongs to one configuration: a run with other settings, or another run's checkpoint, is refused,
never mixed in. checkpoint.pt holds the best epoch's weights too, so best.pt can always be written again.
"""
import fcntl
import json
import logging
import os
import random
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from batchrnn.training.checkpoint import CheckpointError, load_model, save_model
from batchrnn.errors import cannot_write, one_line
from batchrnn.training.identity import mismatch
from batchrnn.storage import atomic_save, atomic_write, write_json

log = logging.getLogger(__name__)
CHECKPOINT, BEST, RESULTS, LOG = "checkpoint.pt", "best.pt", "results.json", "run.log"
LOCK = ".lock"  # held (fcntl.flock) by the process training the run; says who, for the refusal's message
HELD: set[Path] = set()  # the run folders this process holds


class RunError(RuntimeError):
    """A damaged run folder, or one that holds another configuration; the message names the file and the fix."""


def finished_run(path: Path, config: dict) -> dict | None:
    """The results of the finished run in `path` when it has these settings; None for anything else (no
    results, unreadable ones, an unfinished run, other settings), which train() handles and explains."""
    try:
        found = json.loads((Path(path) / RESULTS).read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(found, dict) and found.get("status") == "finished" and isinstance(found.get("config"), dict)
            and not mismatch(found["config"], config)):
        return found
    return None


AFRESH = "train.rerun=true to train this run afresh"  # the fix for a run folder that cannot be resumed


def weights_of(model) -> dict:
    """A copy of the model's state dict in host memory: the best epoch's, kept while training goes on (on a GPU
    it would add to the peak memory that results.json reports)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        with self.writing(self.path):
            self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    @contextmanager
    def writing(self, path: Path):
        """A full disk or a folder this process may not write in, met while writing path, as a RunError. Files are
        replaced whole (storage.atomic_write), so the run resumes where it was once the fault is mended."""
        try:
            yield
        except OSError as e:
            if (problem := cannot_write(e, path)) is None:
                raise
            raise RunError(f"{problem}; then run the same command again (the run resumes from its last complete "
                           "epoch)") from e

    @contextmanager
    def lock(self):
        """This process alone trains the run while it holds the folder: a second process (the same command in
        another terminal, a second `make studies`) is refused at once. An OS lock, so a process killed even
        with -9 leaves nothing behind that would block its resume."""
        key = self.path.resolve()
        if key in HELD:  # this process holds it already (src/run.py takes it before the run's log opens)
            yield
            return
        with self.writing(self.file(LOCK)):  # a read-only folder
            handle = open(self.file(LOCK), "a+")
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise RunError(f"is being trained by {holder}; wait for it to end, or stop it (a stopped run "
                               "resumes) and run this again") from None
            except OSError as e:  # a filesystem without flock (some NFS, Lustre without -o flock)
                raise RunError(f"{self.file(LOCK)}: cannot be locked on this filesystem ({one_line(e)}); put "
                               "the study folder on a local disk") from e
            handle.seek(0)
            handle.truncate()
            handle.write(f"process {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
            handle.flush()
            HELD.add(key)
            try:
                yield
            finally:
                HELD.discard(key)
                handle.seek(0)
                handle.truncate()  # no stale holder for the next process to read
                fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            handle.close()

    def results(self) -> dict:
        """results.json as written last, {} when there is none. A damaged one (written atomically, so damaged
        from outside) is moved aside and rebuilt from the checkpoint."""
        path = self.file(RESULTS)
        if not path.exists():
            return {}
        try:
            done = json.loads(path.read_text())
            if not isinstance(done, dict):
                raise ValueError("not a JSON object")
            return done
        except (OSError, ValueError) as e:
            aside = path.with_name(RESULTS + ".unreadable")
            path.replace(aside)
            log.warning("%s: unreadable (%s), moved to %s; it is rebuilt from %s", path, one_line(e), aside.name,
                        CHECKPOINT)
            return {}

    def check_settings(self, config: dict) -> None:
        """Refuse a folder whose run has other result-affecting settings (a hand-made folder name, or a
        schema default changed since): resuming would mix two configurations in one run."""
        stored = self.results().get("config")
        differ = mismatch(stored, config) if stored else []
        if differ:
            raise RunError(f"{self.path}: holds a run with other settings ({', '.join(differ[:5])}); move that "
                           "folder away, or train.rerun=true to replace it")

    def adopt(self, source_study: Path, config: dict, preset: str | None) -> bool:
        """Takes the finished run of the same name (so the same settings) from another study's folder,
        when this folder has no results yet: its results, model and log are copied, its results marked
        with where they came from and filed under this study. True when it did."""
        source = Path(source_study) / self.path.name
        if self.file(RESULTS).exists() or source.resolve() == self.path.resolve():
            return False
        if (found := finished_run(source, config)) is None:  # none there, unreadable, or not it: train here
            return False
        if config["model"]["bn"] in config["protocol"].get("reuse_needs_model", []) and not (source / BEST).exists():
            log.info("%s: the finished run %s has no %s, which protocol.reuse_needs_model asks of model.bn=%s; "
                     "trained here", self.path, source, BEST, config["model"]["bn"])
            return False
        if (source / BEST).exists():
            atomic_write(self.file(BEST), lambda tmp: shutil.copyfile(source / BEST, tmp))
        if (source / LOG).exists():  # in place, not replaced: the run's log handler (logging()) has it open and
            shutil.copyfile(source / LOG, self.file(LOG))  # appends after the copy, the line below among it
        # filed under this study's bookkeeping (neutral settings): its protocol's stage and seed lists, so that
        # the run counts in this study as one of its own; where it was trained stays in reused_from and commit
        found["config"] = found["config"] | {"study": config["study"], "protocol": config["protocol"]}
        self.write_results(found | {"study": config["study"], "preset": preset, "reused_from": str(source)})
        log.info("%s: the finished run %s has the same settings; taken, not trained again", self.path, source)
        return True

    def start(self, rerun: bool) -> None:
        if rerun:
            for name in (CHECKPOINT, BEST, RESULTS):
                self.file(name).unlink(missing_ok=True)
        for tmp in self.path.glob(".*.tmp"):  # atomic_write's leftovers from a killed process
            tmp.unlink(missing_ok=True)

    def write_results(self, results: dict) -> None:
        with self.writing(self.file(RESULTS)):
            write_json(self.file(RESULTS), results)

    def load(self, name: str, device: torch.device, weights_only: bool):
        path = self.file(name)
        try:
            return torch.load(path, map_location=device, weights_only=weights_only)
        except Exception as e:  # only complete files are renamed into place, so this is real damage
            raise RunError(f"{path}: unreadable ({one_line(e)}); {AFRESH}") from e

    def save_checkpoint(self, model, opt, progress: dict, config: dict, best: dict | None) -> None:
        """config: the run's resolved config, what a resume checks the checkpoint against; best: the best epoch's
        weights (weights_of) where that epoch is not the last one, whose weights are the model's."""
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "progress": progress, "config": config,
                 "best": best, "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                                       # SpecAugment draws its masks on the batch's device
                                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
        with self.writing(self.file(CHECKPOINT)):
            atomic_save(self.file(CHECKPOINT), state)

    def resume(self, model, opt, device: torch.device, config: dict, lead: bool = True) -> tuple[dict, dict | None]:
        """Loads the last complete epoch into model and opt (and the RNG); returns its progress ({} to start
        afresh) and the best epoch's weights (None before the first epoch). best.pt is checked here, before any
        epoch trains, and the lead (rank 0) writes it again from the checkpoint where it cannot be used."""
        path = self.file(CHECKPOINT)
        if not path.exists():
            # written before results.json each epoch: without it, epochs on record would be trained again
            if epochs := len(self.results().get("epochs") or []):
                raise RunError(f"{path}: missing, though {RESULTS} records {epochs} complete epoch"
                               f"{'s' * (epochs > 1)}; put it back to resume, or {AFRESH}")
            return {}, None
        state = self.load(CHECKPOINT, device, weights_only=False)  # holds Python's RNG state, a tuple
        # another run's checkpoint, copied in: its epochs would be filed under these settings (a checkpoint
        # written before checkpoints held their config cannot be told apart)
        if isinstance(state, dict) and isinstance(state.get("config"), dict) and (
                differ := mismatch(state["config"], config)):
            raise RunError(f"{path}: the checkpoint of another run (other {', '.join(differ[:5])}); put it back in "
                           f"its own run's folder, or {AFRESH}")
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            progress = state["progress"]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:  # another model's checkpoint in this folder
            raise RunError(f"{path}: does not fit this model ({type(e).__name__}); use another output folder, or "
                           f"{AFRESH}") from e
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"].get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        log.info("resumed %s at epoch %d", self.path, progress["epoch"])
        return progress, self.checked_best(state, progress, model, config, lead)

    def checked_best(self, state: dict, progress: dict, model, config: dict, lead: bool) -> dict | None:
        """The best epoch's weights, from the checkpoint; best.pt written again from them where it is missing,
        unreadable, of other settings or of another epoch. A checkpoint of an earlier version, without them:
        best.pt's, which must then be sound."""
        if not progress["best_epoch"]:
            return None
        last = progress["best_epoch"] == progress["epoch"]
        weights = state["model"] if last else state.get("best")
        if weights is not None:
            weights = {k: v.to("cpu") for k, v in weights.items()}
        if lead and (fault := self.best_fault(config, progress["best_epoch"] if weights is not None else None)):
            if weights is None:
                raise RunError(f"{self.file(BEST)}: {fault}, and {CHECKPOINT} (of an earlier version) does not hold "
                               f"the best epoch's weights to write it again; {AFRESH}")
            with self.writing(self.file(BEST)):
                save_model(self.file(BEST), model, config, weights, epoch=progress["best_epoch"],
                           val_wer=progress["best_val_wer"])
            log.warning("%s: %s; written again from %s (epoch %d, the best)", self.file(BEST), fault, CHECKPOINT,
                        progress["best_epoch"])
        if weights is None:
            weights = self.best_weights()
        return weights

    def best_fault(self, config: dict, epoch: int | None = None) -> str | None:
        """What makes best.pt unusable as this run's model (of epoch `epoch`, where given), or None."""
        path = self.file(BEST)
        if not path.exists():
            return "missing"
        try:
            _, info = load_model(path)
        except CheckpointError as e:  # its message names the file and the fix for evaluate: only the reason here
            return str(e).removeprefix(f"{path}: ").split("; ")[0]
        if differ := mismatch(info["config"], config):
            return f"a model of other settings ({', '.join(differ[:5])})"
        if epoch is not None and info.get("epoch") != epoch:
            return f"the model of epoch {info.get('epoch')}, not of the best epoch, {epoch}"
        return None

    def save_best(self, model, config: dict, **extra) -> None:
        """best.pt: the model with what rebuilds it (batchrnn.training.checkpoint), usable outside this folder."""
        with self.writing(self.file(BEST)):
            save_model(self.file(BEST), model, config, **extra)

    def best_weights(self) -> dict:
        try:
            return load_model(self.file(BEST))[0].state_dict()
        except CheckpointError as e:
            raise RunError(f"{e}; or {AFRESH}") from e

    @contextmanager
    def logging(self, rank: int = 0):
        """The run's own log file beside its results, while the run lasts (Hydra's log is the terminal's); with
        several ranks, rank 0's is run.log and each other rank's rank<N>.log."""
        handler = logging.FileHandler(self.file(LOG if rank == 0 else f"rank{rank}.log"))
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)
            handler.close()


# results.json's figures that the report and the protocol compute with: each a number, or null before the run ends
FIGURES = ("test_wer", "test_cer", "test_loss", "best_val_wer", "best_epoch", "train_loss_at_best", "lr_at_stop",
           "epoch_time_s", "peak_mem_mb")


def figure_fault(result: dict) -> str | None:
    """What makes a results file's figures (FIGURES, and every epoch's row) unusable, or None."""
    def number(v) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    if bad := next((k for k in FIGURES if not number(result.get(k))), None):
        return f"{bad} is {result[bad]!r}, not a number"
    epochs = result.get("epochs") or []
    if not isinstance(epochs, list) or not all(isinstance(row, dict) for row in epochs):
        return "epochs is not a list of rows"
    for i, row in enumerate(epochs, 1):
        if bad := next((k for k, v in row.items() if not number(v)), None):
            return f"epoch {i}'s {bad} is {row[bad]!r}, not a number"
    return None


def read_study(study_dir: Path) -> tuple[list[dict], list[Path]]:
    """Every results.json under study_dir (each dict gets "path", its run folder), and the unreadable ones (a
    figure that is not a number among them)."""
    results, unreadable = [], []
    for path in sorted(Path(study_dir).rglob(RESULTS)):
        try:
            result = json.loads(path.read_text())
            if not isinstance(result, dict) or not isinstance(result.get("config"), dict):
                raise ValueError("not a results file with a config")
            if fault := figure_fault(result):
                raise ValueError(fault)
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            unreadable.append(path)
            log.warning("skipping %s: %s; rerun that run or delete the file", path, one_line(e))
            continue
        results.append(result | {"path": str(path.parent)})
    return results, unreadable
