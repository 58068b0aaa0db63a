"""The trainer: one variant on one corpus with CTC; per-epoch metrics, checkpoints, results.json.

A run lives in one folder. Restarted with the same folder it resumes from its last complete epoch;
a finished run is left alone unless train.rerun=true.
"""
import json
import logging
import math
import random
import re
import resource
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from batchrnn.checkpoint import save_model
from batchrnn.config import ConfigError, Device, Impl, to_container, validate
from batchrnn.data import corpus_changes, one_line, prepare_corpus
from batchrnn.features import FeatureSet, collate, load_features, make_batches
from batchrnn.metrics import error_rates
from batchrnn.storage import atomic_write, write_json
from batchrnn.model import DeepSpeech2
from batchrnn.text import LABELS, greedy_decode
from batchrnn.tracking import start_tracking

log = logging.getLogger(__name__)
CHECKPOINT, BEST, RESULTS = "checkpoint.pt", "best.pt", "results.json"


class RunError(RuntimeError):
    """A damaged run folder (unreadable checkpoint); the message names the file and the fix."""


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the checkpoint and results.json keep the epochs before."""


def pick_device(choice: Device) -> torch.device:
    if Device(choice) is Device.cuda and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available; use train.device=auto or cpu")
    if Device(choice) is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: restart the peak resident set count (VmHWM), so each epoch and each job of a sweep is its own
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak stays process-wide


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max allocated by tensors since the last reset. CPU: peak resident set since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def ctc_feasible(model: DeepSpeech2, fs: FeatureSet) -> list[bool]:
    """CTC needs at least one output frame per label, plus a blank between repeated letters."""
    frames = model.front_end.output_lengths(torch.tensor(fs.lengths)).tolist()
    need = [len(t) + sum(a == b for a, b in zip(t, t[1:])) for t in fs.texts]
    return [n <= f for n, f in zip(need, frames)]


CTC = torch.nn.CTCLoss(blank=0, zero_infinity=True)


def ctc_loss(model: DeepSpeech2, x, x_lens, y, y_lens, amp: bool):
    """CTC loss of a batch, with the log-probabilities and output lengths it was computed from."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        logits, out_lens = model(x, x_lens)
    log_probs = logits.float().log_softmax(-1)
    return CTC(log_probs, y, out_lens, y_lens), log_probs, out_lens


@torch.no_grad()
def score(model: DeepSpeech2, fs: FeatureSet, batch_size: int, device: torch.device, amp: bool,
          progress: bool = False) -> dict:
    """Loss, WER and CER of a feature set with greedy decoding, and each utterance's hypothesis."""
    model.eval()
    ids, refs, hyps, total = [], [], [], 0.0
    batches = make_batches(fs.lengths, batch_size, shuffle=False, seed=0)
    for indices in tqdm(batches, desc="scoring", unit="batch", disable=not progress):
        x, x_lens, y, y_lens = [b.to(device, non_blocking=True) for b in collate(fs, indices)]
        loss, log_probs, out_lens = ctc_loss(model, x, x_lens, y, y_lens, amp)
        total += loss.item() * len(indices)
        hyps += greedy_decode(log_probs, out_lens)
        refs += [fs.texts[i] for i in indices]
        ids += [fs.ids[i] for i in indices]
    wer, cer = error_rates(refs, hyps)
    return {"loss": total / len(fs), "wer": wer, "cer": cer,
            "utterances": [{"id": i, "ref": r, "hyp": h} for i, r, h in zip(ids, refs, hyps)]}


class Trainer:
    def __init__(self, cfg: DictConfig, out_dir: Path, preset: str | None = None):
        validate(cfg)
        self.cfg, self.out_dir, self.preset = cfg, Path(out_dir), preset
        self.out_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.device = pick_device(t.device)
        self.amp = t.amp and self.device.type == "cuda"
        seed_everything(cfg.seed)

        corpus = prepare_corpus(cfg.data)
        self.corpus_summary = corpus.summary
        for line in corpus_changes(corpus.summary):  # the same counts are in results.json under "corpus"
            log.warning("%s", line)
        self.sets = {s: load_features(corpus, s, cfg.data) for s in ("train", "val", "test")}
        num_features = self.sets["train"].num_features
        self.model = DeepSpeech2(cfg.model, num_features, len(LABELS)).to(self.device)
        self.params = sum(p.numel() for p in self.model.parameters())

        feasible = ctc_feasible(self.model, self.sets["train"])
        self.train_indices = [i for i, ok in enumerate(feasible) if ok]
        self.ctc_skipped = [self.sets["train"].ids[i] for i, ok in enumerate(feasible) if not ok]
        if not self.train_indices:
            raise ConfigError("no training utterance has enough output frames for its labels under CTC; "
                              "lower the time strides in model.conv")
        if self.ctc_skipped:
            log.warning("%d training utterances have more labels than the model's output frames allow "
                        "for CTC and are left out of training: %s", len(self.ctc_skipped), self.ctc_skipped[:10])

        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.epoch, self.step, self.history = 0, 0, []
        self.best = {"val_wer": math.inf, "epoch": 0}
        self.skipped_steps, self.skipped_in_a_row = 0, 0

    # --- persistence -------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        state = {
            "model": self.model.state_dict(), "opt": self.opt.state_dict(), "epoch": self.epoch,
            "step": self.step, "history": self.history, "best": self.best, "skipped_steps": self.skipped_steps,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        atomic_write(self.out_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def load(self, name: str, weights_only: bool):
        path = self.out_dir / name
        try:
            return torch.load(path, map_location=self.device, weights_only=weights_only)
        except Exception as e:  # only complete files are renamed into place, so this is real damage
            raise RunError(f"{path}: unreadable ({one_line(e)}); delete {CHECKPOINT} and {BEST} in that folder "
                           "to train this run afresh") from e

    def resume(self) -> bool:
        if not (self.out_dir / CHECKPOINT).exists():
            return False
        state = self.load(CHECKPOINT, weights_only=False)
        try:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
        except (KeyError, RuntimeError, ValueError) as e:  # another model's checkpoint in this folder
            raise RunError(f"{self.out_dir / CHECKPOINT}: does not fit this model ({type(e).__name__}); use "
                           "another output folder, or train.rerun=true to replace this run") from e
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        self.best, self.skipped_steps = state["best"], state["skipped_steps"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        log.info("resumed %s at epoch %d", self.out_dir, self.epoch)
        return True

    # --- training ------------------------------------------------------------------------------
    def lr_at(self, epoch: int, step: int) -> float:
        t = self.cfg.train
        warmup = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps > 0 else 1.0
        return t.lr * warmup * t.lr_gamma ** (epoch - 1)

    def batch_to_device(self, batch):
        return [b.to(self.device, non_blocking=True) for b in batch]

    def train_epoch(self) -> dict:
        t, fs = self.cfg.train, self.sets["train"]
        self.model.train()
        lengths = [fs.lengths[i] for i in self.train_indices]
        shuffle = not (t.sortagrad and self.epoch == 1)
        batches = [[self.train_indices[i] for i in b]
                   for b in make_batches(lengths, t.batch_size, shuffle, seed=self.cfg.seed * 1000 + self.epoch)]
        total, count = 0.0, 0
        bar = tqdm(batches, desc=f"epoch {self.epoch}", unit="batch", leave=False, mininterval=2)
        for indices in bar:
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.epoch, self.step)
            x, x_lens, y, y_lens = self.batch_to_device(collate(fs, indices))
            # BN running averages move in the forward pass: a skipped step must take them back too.
            buffers = [b.clone() for b in self.model.buffers()]
            loss, _, _ = ctc_loss(self.model, x, x_lens, y, y_lens, self.amp)
            self.opt.zero_grad(set_to_none=True)
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
                self.skip_step(buffers, [fs.ids[i] for i in indices])
                continue
            self.opt.step()
            self.step += 1
            self.skipped_in_a_row = 0
            total += loss.item() * len(indices)
            count += len(indices)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        return {"train_loss": total / count if count else math.nan, "utterances": count}

    def skip_step(self, buffers: list[torch.Tensor], ids: list[str]) -> None:
        """A non-finite step would poison AdamW's moments for good: drop it, count it, and stop the run
        when they keep coming, since the model has then diverged."""
        for b, saved in zip(self.model.buffers(), buffers):
            b.copy_(saved)
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        log.warning("epoch %d step %d: non-finite loss or gradient, step skipped (%d in a row); batch: %s",
                    self.epoch, self.step, self.skipped_in_a_row, " ".join(ids))
        if self.skipped_in_a_row > self.cfg.train.max_skipped_steps:
            raise TrainingDiverged(
                f"{self.out_dir}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradient in "
                f"epoch {self.epoch}; the run has diverged. Lower train.lr (now {self.cfg.train.lr:g}) or "
                f"check the data; {RESULTS} and {CHECKPOINT} are as after epoch {self.epoch - 1}")

    def evaluate(self, split: str, state: dict | None = None) -> dict:
        """score() of a split; optionally with another state dict."""
        if state is not None:
            self.model.load_state_dict(state)
        return score(self.model, self.sets[split], self.cfg.train.batch_size, self.device, self.amp)

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        results_path = self.out_dir / RESULTS
        if results_path.exists() and not t.rerun:
            try:
                done = json.loads(results_path.read_text())
                if not isinstance(done, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:  # written atomically, so damaged from outside: rebuild it
                aside = results_path.with_name(RESULTS + ".unreadable")
                results_path.replace(aside)
                log.warning("%s: unreadable (%s), moved to %s; it is rebuilt from %s", results_path, one_line(e),
                            aside.name, CHECKPOINT)
                done = {}
            if done.get("status") == "finished":
                log.info("%s is finished; train.rerun=true runs it again", self.out_dir)
                return done
        if t.rerun:
            for name in (CHECKPOINT, BEST, RESULTS):
                (self.out_dir / name).unlink(missing_ok=True)
        for tmp in self.out_dir.glob(".*.tmp"):  # storage.atomic_write's leftovers from a killed process
            tmp.unlink(missing_ok=True)
        self.resume()
        name = run_name(cfg)
        tracker = start_tracking(cfg.logger, self.out_dir, f"{name}-s{cfg.seed}", cfg.study, to_container(cfg))
        log.info("%s: %d parameters on %s, %d/%d/%d utterances (train/val/test), tracking %s",
                 name, self.params, self.device, len(self.train_indices), len(self.sets["val"]),
                 len(self.sets["test"]), tracker.mode)
        try:
            self.train_epochs(tracker)
        except TrainingDiverged as e:
            # The epochs are those of the last complete one; the status and error say why it stopped.
            write_json(results_path, self.summary("diverged") | {"error": str(e)})
            tracker.finish()  # a sweep goes on with its next job, which starts its own W&B run
            raise
        best_state = self.load(BEST, weights_only=True)["state_dict"]
        test = self.evaluate("test", best_state)
        results = self.summary("finished") | {
            "test_wer": test["wer"], "test_cer": test["cer"], "test_loss": test["loss"],
            "test_utterances": test["utterances"],
        }
        write_json(results_path, results)
        # rnn, bn, impl and seed beside the metrics: flat columns a W&B table can sort and group by
        tracker.summary({k: results[k] for k in ("rnn", "bn", "impl", "seed", "test_wer", "test_cer",
                                                   "best_val_wer", "best_epoch", "epoch_time_s", "peak_mem_mb",
                                                   "params")})
        tracker.finish()
        log.info("%s: test WER %.1f%%, CER %.1f%% (best validation epoch %d)", name, 100 * test["wer"],
                 100 * test["cer"], self.best["epoch"])
        return results

    def train_epochs(self, tracker) -> None:
        """Train, validate and checkpoint epoch by epoch up to train.epochs (or patience)."""
        t, results_path = self.cfg.train, self.out_dir / RESULTS
        stale = self.epoch - self.best["epoch"]  # a resumed run keeps its patience count
        while self.epoch < t.epochs and not (t.patience and stale >= t.patience):
            self.epoch += 1
            reset_peak_memory(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            train = self.train_epoch()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            peak_mb = peak_memory_mb(self.device)  # of the training epoch, before evaluation
            val = self.evaluate("val")
            row = {"epoch": self.epoch, "train_loss": train["train_loss"], "val_loss": val["loss"],
                   "val_wer": val["wer"], "val_cer": val["cer"], "epoch_time_s": seconds,
                   "peak_mem_mb": peak_mb, "utt_per_s": train["utterances"] / seconds,
                   "lr": self.opt.param_groups[0]["lr"], "skipped_steps": self.skipped_steps}
            self.history.append(row)
            if val["wer"] < self.best["val_wer"]:
                self.best = {"val_wer": val["wer"], "epoch": self.epoch}
                save_model(self.out_dir / BEST, self.model, to_container(self.cfg), epoch=self.epoch,
                           val_wer=val["wer"])
            stale = self.epoch - self.best["epoch"]
            self.save_checkpoint()
            write_json(results_path, self.summary("running"))
            tracker.log({"train/loss": row["train_loss"], "val/loss": row["val_loss"], "val/wer": row["val_wer"],
                         "val/cer": row["val_cer"], "epoch/time_s": seconds, "epoch/peak_mem_mb": row["peak_mem_mb"],
                         "epoch/utt_per_s": row["utt_per_s"], "train/lr": row["lr"]}, step=self.epoch)
            log.info("epoch %d: train loss %.3f, val loss %.3f, val WER %.1f%%, CER %.1f%%, %.1f s, %.0f MB",
                     self.epoch, row["train_loss"], row["val_loss"], 100 * row["val_wer"], 100 * row["val_cer"],
                     seconds, row["peak_mem_mb"])

    def summary(self, status: str) -> dict:
        cfg = to_container(self.cfg)
        times = [r["epoch_time_s"] for r in self.history]
        return {
            "status": status, "preset": self.preset, "config": cfg, "rnn": cfg["model"]["rnn"], "bn": cfg["model"]["bn"],
            "impl": cfg["model"]["impl"], "seed": self.cfg.seed, "study": self.cfg.study,
            "epochs": self.history, "best_epoch": self.best["epoch"], "best_val_wer": self.best["val_wer"],
            "epoch_time_s": sum(times) / len(times) if times else None,
            "peak_mem_mb": max((r["peak_mem_mb"] for r in self.history), default=None),
            "params": self.params, "device": self.device.type, "torch_version": torch.__version__,
            "skipped_steps": self.skipped_steps, "ctc_skipped_utterances": self.ctc_skipped,
            "corpus": self.corpus_summary,
        }


def run_name(cfg: DictConfig) -> str:
    """rnn-bn[-impl]: the W&B run name and the report's variant label."""
    m = to_container(cfg.model)
    return f"{m['rnn']}-{m['bn']}" + ("-cells" if Impl(m["impl"]) is Impl.cells else "")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: DictConfig, out_dir: Path, preset: str | None = None) -> dict:
    """Run (or resume, or skip if finished) one training run in out_dir; preset names the experiment."""
    return Trainer(cfg, out_dir, preset).run()
