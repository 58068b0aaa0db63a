"""The trainer: one variant on one corpus with CTC, epoch by epoch until validation stops improving.

`train(cfg, folder)` runs, resumes from the last complete epoch, or returns a finished run's results.
The run folder's files are batchrnn.training.rundir's business; this module is the loop and what it measures.
"""
import contextlib
import functools
import logging
import math
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from batchrnn.config import ConfigError, Decoder, Schedule, to_container
from batchrnn.validation import validate
from batchrnn.data.base import corpus_changes
from batchrnn.data.corpus import prepare_corpus, unwritable
from batchrnn.training.device import machine, peak_memory_mb, pick_device, reset_peak_memory, synchronize, uses_bf16
from batchrnn.data.features import FeatureSet, collate, load_features, make_batches
from batchrnn.metrics import error_rates
from batchrnn.layers import cpu_front_end
from batchrnn.model import DeepSpeech2
from batchrnn.training.identity import settings, variant_label
from batchrnn.training import distributed, stopping
from batchrnn.training.rundir import BEST, CHECKPOINT, RESULTS, RunError, RunFolder, weights_of
from batchrnn.data.text import LABELS, greedy_decode
from batchrnn.tracking.tracker import Tracker, start_tracking
from batchrnn.progress import progress_bar
from batchrnn.training.augment import SpecAugment

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the checkpoint and results.json keep the epochs before."""


@dataclass
class Progress:
    """Where a run stands after its last complete epoch: all a checkpoint holds besides the weights."""
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    history: list[dict] = field(default_factory=list)  # one row per epoch, the per-epoch metrics
    best_val_wer: float = math.inf
    best_epoch: int = 0  # of the best validation WER: the checkpoint that is tested
    loss_mark: float = math.inf  # validation loss at the last epoch it counted as an improvement
    improved_epoch: int = 0  # the last epoch that improved validation WER or loss: patience counts from it
    skipped_steps: int = 0
    skipped_in_a_row: int = 0  # across epochs: a run that diverges at an epoch's end is still diverged
    lr_cuts: int = 0  # schedule=plateau: the rate's cuts so far (it is lr x plateau_factor ** lr_cuts)
    cut_epoch: int = 0  # the epoch after which the last cut was made

    def judge(self, val_wer: float, val_loss: float, t) -> bool:
        """Takes an epoch's validation: the best epoch, improvement (what patience counts) and, under
        schedule=plateau, a cut of the rate. True when this epoch is the best so far (its model is kept)."""
        best = val_wer < self.best_val_wer
        if best:
            self.best_val_wer, self.best_epoch = val_wer, self.epoch
        # Loss too: a network still at blank output (100% WER) for its first epochs is learning while
        # its loss falls, and patience on WER alone would stop it before it ever emits a letter. Only a
        # real fall counts (train.patience_loss_drop since the last one): near convergence the loss
        # drifts down by fractions of a percent for many epochs while WER no longer moves.
        if val_loss < self.loss_mark * (1 - t.patience_loss_drop):
            self.loss_mark, self.improved_epoch = val_loss, self.epoch
        if best:
            self.improved_epoch = self.epoch
        if (Schedule(t.schedule) is Schedule.plateau and self.step >= t.warmup_steps and not self.blank(t)
                and self.epoch - max(self.improved_epoch, self.cut_epoch) >= t.plateau_wait):
            self.lr_cuts, self.cut_epoch = self.lr_cuts + 1, self.epoch
        return best

    def blank(self, t) -> bool:
        """Under plateau_hold_blank, whether the network has not yet got a validation word right (no cut then)."""
        return t.plateau_hold_blank and self.best_val_wer >= 1.0

    def lr_scale(self, t) -> float:
        """The rate of the next epoch over train.lr, warm-up aside."""
        if Schedule(t.schedule) is Schedule.plateau:
            return t.plateau_factor ** self.lr_cuts
        return t.lr_gamma ** self.epoch

    def stop(self, t) -> str | None:
        """Why the run ends now: floor (schedule=plateau: the rate fell below plateau_floor x lr), patience
        (no improvement for train.patience epochs; under plateau only after plateau_min_cuts cuts and an epoch
        at the last cut's rate, or while still blank), cap (train.epochs), or None to go on."""
        plateau = Schedule(t.schedule) is Schedule.plateau
        if plateau and self.lr_scale(t) < t.plateau_floor:
            return "floor"
        # under plateau, only once the run has been cut plateau_min_cuts times and trained an epoch at that rate,
        # or while it is still blank (no cut comes then: it is stuck)
        if (t.patience and self.epoch - self.improved_epoch >= t.patience
                and (not plateau or self.blank(t)
                     or (self.lr_cuts >= t.plateau_min_cuts and self.epoch > self.cut_epoch))):
            return "patience"
        return "cap" if self.epoch >= t.epochs else None


class Run:
    """What one training run is made of: its data, model, optimizer, loss and augmentation."""

    def __init__(self, cfg: DictConfig):
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.cfg, self.device = cfg, distributed.start(pick_device(t.device), t.dist_timeout_s)
        self.bf16 = uses_bf16(t, self.device)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        try:
            with distributed.one_at_a_time(cfg.data.root):  # ranks, a parallel sweep: the first prepares, the others read
                corpus = prepare_corpus(cfg.data)
                self.sets = {s: load_features(corpus, s, cfg.data) for s in ("train", "val", "test")}
        except OSError as e:  # a full disk, a read-only data.root
            if (full := unwritable(e)) is None:
                raise
            raise full from e
        self.corpus_summary = corpus.summary
        for line in corpus_changes(corpus.summary):  # the same counts are in results.json under "corpus"
            log.warning("%s", line)
        self.model = DeepSpeech2(cfg.model, self.sets["train"].num_features, len(LABELS)).to(self.device)
        self.replicated = distributed.wrap(self.model, self.device)  # what training steps call: DDP with ranks
        self.params = sum(p.numel() for p in self.model.parameters())
        # fused: one kernel per step over every parameter, where the default loops over them op by op (13 small
        # operations each on the CPU); the same update up to float rounding
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=True)
        self.ctc = torch.nn.CTCLoss(blank=0, zero_infinity=True)
        augment = SpecAugment(t.spec_augment, cfg.seed)
        augment.check(self.sets["train"].lengths)
        self.augment = augment if augment.active else None

        feasible = ctc_feasible(self.model, self.sets["train"])
        self.train_indices = [i for i, ok in enumerate(feasible) if ok]
        self.ctc_skipped = [self.sets["train"].ids[i] for i, ok in enumerate(feasible) if not ok]
        if not self.train_indices:
            raise ConfigError("no training utterance has enough output frames for its labels under CTC; "
                              "lower the time strides in model.conv")
        if self.ctc_skipped:
            log.warning("%d training utterances have more labels than the model's output frames allow "
                        "for CTC and are left out of training: %s", len(self.ctc_skipped), self.ctc_skipped[:10])

    def lr_at(self, progress: Progress) -> float:
        """The rate of the step progress is at: warm-up, then the schedule (its cuts are in progress, which
        the checkpoint holds, so a resumed run goes on at the same rate)."""
        t = self.cfg.train
        warmup = min(1.0, (progress.step + 1) / t.warmup_steps) if t.warmup_steps > 0 else 1.0
        before = replace(progress, epoch=progress.epoch - 1)  # the scale set after the previous epoch
        return t.lr * warmup * before.lr_scale(t)

    def loss(self, x, x_lens, y, y_lens):
        return ctc_loss(self.replicated, self.ctc, x, x_lens, y, y_lens, self.bf16)


def ctc_loss(model, ctc, x, x_lens, y, y_lens, bf16: bool):
    """CTC loss, log-probabilities (T, N, classes) and output lengths; the loss in float32 under autocast."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, out_lens = model(x, x_lens)
    log_probs = logits.float().log_softmax(-1)
    return ctc(log_probs, y, out_lens, y_lens), log_probs, out_lens


def ctc_feasible(model: DeepSpeech2, fs: FeatureSet) -> list[bool]:
    """CTC needs at least one output frame per label, plus a blank between repeated letters."""
    frames = model.front_end.output_lengths(torch.tensor(fs.lengths)).tolist()
    need = [len(t) + sum(a == b for a, b in zip(t, t[1:])) for t in fs.texts]
    return [n <= f for n, f in zip(need, frames)]


@torch.no_grad()
def score(model, fs: FeatureSet, batch_size: int, device: torch.device, bf16: bool = False,
          progress: bool = False) -> dict:
    """Loss, WER and CER of a feature set with greedy decoding, and each utterance's hypothesis. With several
    ranks each scores its share of every batch (BatchNorm's running moments are equal on every rank), and the
    loss sums and hypotheses are gathered: the same figures as one process, at 1/N of the time."""
    model.eval()
    ctc = torch.nn.CTCLoss(blank=0, zero_infinity=True)
    found, total = {}, 0.0  # found: the utterance's index -> its hypothesis
    batches = make_batches(fs.lengths, batch_size, shuffle=False, seed=0)
    for indices in progress_bar(batches, desc="scoring", unit="batch", disable=not progress):
        stopping.check()
        if not (share := distributed.share(indices)):
            continue
        x, x_lens, y, y_lens = (b.to(device) for b in collate(fs, share))
        loss, log_probs, out_lens = ctc_loss(model, ctc, x, x_lens, y, y_lens, bf16)
        total += loss.item() * len(share)
        found |= dict(zip(share, greedy_decode(log_probs, out_lens)))
    found, total = distributed.merged(found), distributed.total(total)
    order = [i for indices in batches for i in indices]
    ids, refs, hyps = [fs.ids[i] for i in order], [fs.texts[i] for i in order], [found[i] for i in order]
    wer, cer = error_rates(refs, hyps)
    return {"loss": total / len(fs), "wer": wer, "cer": cer,
            "utterances": [{"id": i, "ref": r, "hyp": h} for i, r, h in zip(ids, refs, hyps)]}


def train(cfg: DictConfig, out_dir: Path, preset: str | None = None) -> dict:
    """Run (or resume, or return if finished) one training run in out_dir; preset names the experiment.
    Under torchrun (or SLURM tasks) every rank calls it; rank 0 alone holds the folder and writes its files."""
    validate(cfg)
    distributed.check(cfg)
    folder = RunFolder(out_dir)
    # a second process on the same run is refused here (src/run.py takes the lock before its log)
    try:
        distributed.start(pick_device(cfg.train.device), cfg.train.dist_timeout_s)
        with folder.lock() if distributed.lead() else contextlib.nullcontext():
            return train_in(cfg, folder, preset)
    except BaseException as e:
        distributed.abandon()
        # a rank that stopped answering: one clear error on the others, not a traceback
        if isinstance(e, Exception) and (stopped := distributed.unanswered(e, cfg.train.dist_timeout_s)):
            raise stopped from e
        raise


def opening(cfg: DictConfig, folder: RunFolder, preset: str | None) -> dict | None:
    """The finished run's results, or None after making the folder ready to train (rank 0's part of the start)."""
    config, t = to_container(cfg), cfg.train
    if not t.rerun:
        if cfg.protocol.reuse_from:
            folder.adopt(Path(cfg.protocol.reuse_from), config, preset)
        folder.check_settings(config)
        if (done := folder.results()).get("status") == "finished":
            log.info("%s is finished; train.rerun=true runs it again", folder.path)
            if fault := folder.best_fault(config):  # its results are whole: a study needs nothing more
                log.warning("%s: %s; the run stays finished, but evaluate cannot use it: train.rerun=true trains "
                            "it again", folder.file(BEST), fault)
                return done
            return with_lm(cfg, folder, done, pick_device(t.device))
    folder.start(t.rerun)
    return None


def with_lm(cfg: DictConfig, folder: RunFolder, results: dict, device: torch.device) -> dict:
    """decode.decoder=beam: the finished run decoded with the word LM as well (tuned on validation, test at the chosen
    point: batchrnn.decoding.tuning), into results.json's `lm` beside the greedy figures, which stay as they are. A
    finished run met again with other decode settings is decoded with those; one whose best.pt is gone keeps greedy."""
    if Decoder(cfg.decode.decoder) is not Decoder.beam:
        return results
    if not folder.file(BEST).is_file():
        log.warning("%s: no %s to decode with the LM; its results stay greedy only", folder.path, BEST)
        return results
    from batchrnn.decoding.tuning import decode_run  # loads torchaudio's decoder: only where a beam is asked for

    lm = decode_run(folder.file(BEST), cfg.decode, cfg.data, device)
    if results.get("lm") != lm:
        results = results | {"lm": lm}
        folder.write_results(results)
    log.info("%s: with the LM %s: test WER %.1f%%, CER %.1f%% (LM weight %g, word score %g, chosen on validation: "
             "WER %.1f%%)", folder.path, lm["lm"], 100 * lm["test_wer"], 100 * lm["test_cer"], lm["lm_weight"],
             lm["word_score"], 100 * lm["val_wer"])
    return results


def train_in(cfg: DictConfig, folder: RunFolder, preset: str | None) -> dict:
    """train()'s work, in a run folder this process holds (rank 0) or follows (the other ranks)."""
    config, t, lead = to_container(cfg), cfg.train, distributed.lead()
    try:
        outcome = opening(cfg, folder, preset) if lead else None
    except RunError as e:
        outcome = e
    outcome = distributed.broadcast(outcome)  # the other ranks finish, stop or train as rank 0 does
    if isinstance(outcome, RunError):
        raise outcome
    if outcome is not None:
        return outcome
    run = Run(cfg)
    resumed, best = folder.resume(run.model, run.opt, run.device, config, lead)
    progress = Progress(**resumed)
    name = f"{variant_label(settings(config))}-s{cfg.seed}"
    tracker = start_tracking(cfg.logger, folder.path, name, cfg.study, config) if lead else Tracker()
    log.info("%s: %d parameters on %s%s, %d/%d/%d utterances (train/val/test), tracking %s, folder %s", name,
             run.params, run.device, " (bf16)" * run.bf16, len(run.train_indices), len(run.sets["val"]),
             len(run.sets["test"]), tracker.mode, folder.path)
    # "failed" when wandb could not start at all, which the log warned about: recorded beside the results
    summary = lambda status: results_of(cfg, preset, run, progress, status) | {"tracking": tracker.mode}  # noqa: E731
    with stopping.deferred():  # a SIGTERM ends the run between two steps (batchrnn.training.stopping)
        try:
            while progress.stop(t) is None:
                progress.epoch += 1
                reset_peak_memory(run.device)
                synchronize(run.device)
                start = time.perf_counter()
                epoch = train_epoch(run, progress, tracker)
                synchronize(run.device)
                seconds = time.perf_counter() - start
                val = score(run.model, run.sets["val"], t.batch_size, run.device, run.bf16)
                row = {"epoch": progress.epoch, "train_loss": epoch["loss"], "val_loss": val["loss"],
                       "val_wer": val["wer"], "val_cer": val["cer"], "epoch_time_s": seconds,
                       # of this epoch's training, before validation; with several ranks, the largest rank's
                       "peak_mem_mb": distributed.largest(peak_memory_mb(run.device)),
                       "utt_per_s": epoch["utterances"] / seconds, "lr": run.opt.param_groups[0]["lr"],
                       "skipped_steps": progress.skipped_steps,
                       "grad_norm_mean": epoch["grad_norm_mean"], "grad_norm_max": epoch["grad_norm_max"]}
                progress.history.append(row)
                if progress.judge(val["wer"], val["loss"], t):
                    best = weights_of(run.model)  # tested at the end; in the checkpoint while not the last epoch's
                    if lead:
                        folder.save_best(run.model, config, epoch=progress.epoch, val_wer=val["wer"])
                if lead:
                    folder.save_checkpoint(run.model, run.opt, asdict(progress), config,
                                           None if progress.best_epoch == progress.epoch else best)
                    folder.write_results(summary("running"))
                tracker.log_epoch(row)
                log.info("epoch %d: train loss %.3f, val loss %.3f, val WER %.1f%%, CER %.1f%%, %.1f s, %.0f MB, "
                         "grad norm %.2f (max %.2f)", row["epoch"], row["train_loss"], row["val_loss"],
                         100 * row["val_wer"], 100 * row["val_cer"], seconds, row["peak_mem_mb"],
                         row["grad_norm_mean"], row["grad_norm_max"])
                if progress.lr_cuts and progress.cut_epoch == progress.epoch:
                    log.info("epoch %d: no improvement for %d epochs, so the rate is cut to %.3g of train.lr (cut %d)",
                             progress.epoch, t.plateau_wait, progress.lr_scale(t), progress.lr_cuts)
        except TrainingDiverged as e:
            # The epochs are those of the last complete one; the status and error say why it stopped.
            if lead:
                folder.write_results(summary("diverged") | {"error": str(e)})
            tracker.finish()  # a sweep goes on with its next job, which starts its own W&B run
            raise
        run.model.load_state_dict(best)
        test = score(run.model, run.sets["test"], t.batch_size, run.device, run.bf16)
        results = summary("finished") | {"test_wer": test["wer"], "test_cer": test["cer"], "test_loss": test["loss"],
                                         "test_utterances": test["utterances"]}
        if lead:
            folder.write_results(results)
            results = with_lm(cfg, folder, results, run.device)
    # flat columns a W&B runs table can sort and group by, beside the config
    tracker.summary({k: results[k] for k in ("rnn", "bn", "impl", "seed", "test_wer", "test_cer", "best_val_wer",
                                              "best_epoch", "epoch_time_s", "peak_mem_mb", "params", "stop")})
    tracker.finish()
    log.info("%s: test WER %.1f%%, CER %.1f%% (best validation epoch %d of %d, stopped by %s); %s", name,
             100 * test["wer"], 100 * test["cer"], progress.best_epoch, progress.epoch, results["stop"],
             folder.path)
    return results


def gradient(run: Run, indices: list[int], epoch: int) -> tuple[float, torch.Tensor | None]:
    """The mean loss's gradient over a batch of training utterances, in the parameters' .grad (summed over the ranks,
    each of which takes its share); returns the batch's loss summed over its utterances and the pre-clip gradient
    norm, None where the loss or the gradient is not finite (on any rank: every rank skips the same steps)."""
    t, fs = run.cfg.train, run.sets["train"]
    # With several ranks this rank's share of the batch; a rank with none runs a stand-in that counts nothing,
    # so that it takes part in every collective (distributed.ghost)
    mine = distributed.share(indices)
    used = mine or indices[:1]
    x, x_lens, y, y_lens = (b.to(run.device, non_blocking=True) for b in collate(fs, used))
    if run.augment is not None:
        x = run.augment(x, x_lens, [fs.ids[i] for i in used], epoch)
    with distributed.ghost(not mine):
        loss, _, _ = run.loss(x, x_lens, y, y_lens)
    summed, finite = distributed.batch_loss(loss, len(mine))  # one all-reduce: the sum, and whether to skip
    run.opt.zero_grad(set_to_none=True)
    if not finite:
        return summed, None
    distributed.share_loss(loss, len(mine), len(indices)).backward()  # DDP all-reduces the gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), t.max_grad_norm)  # the pre-clip norm
    return summed, grad_norm if distributed.agree(torch.isfinite(grad_norm)) else None


def epoch_batches(run: Run, epoch: int) -> list[list[int]]:
    """The training batches of an epoch, in the order it takes them, as indices into run.train_indices."""
    t, fs = run.cfg.train, run.sets["train"]
    lengths = [fs.lengths[i] for i in run.train_indices]
    shuffle = not (t.sortagrad and epoch == 1)  # DS2's SortaGrad: epoch 1 in length order
    return make_batches(lengths, t.batch_size, shuffle, seed=run.cfg.seed * 1000 + epoch)


def train_epoch(run: Run, progress: Progress, tracker) -> dict:
    """One pass over the training batches; returns the mean loss, utterances seen and the pre-clip
    gradient norms' mean and max (the signal of a deep plain network that stalls)."""
    t, fs, model = run.cfg.train, run.sets["train"], run.model
    model.train()
    batches = epoch_batches(run, progress.epoch)
    total, count, norms = 0.0, 0, []
    bar = progress_bar(batches, desc=f"epoch {progress.epoch}", unit="batch", leave=False, mininterval=2)
    for batch in bar:
        stopping.check()  # a SIGTERM since the last step ends the run here, between two steps
        indices = [run.train_indices[i] for i in batch]
        lr = run.lr_at(progress)
        for group in run.opt.param_groups:
            group["lr"] = lr
        buffers = [b.clone() for b in model.buffers()]  # BN running averages: a skipped step restores them
        summed, grad_norm = gradient(run, indices, progress.epoch)
        finite = grad_norm is not None
        if not finite:
            # A non-finite step would poison AdamW's moments for good: drop it, count it, and stop the run
            # when they keep coming, since the model has then diverged.
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
            progress.skipped_steps += 1
            progress.skipped_in_a_row += 1
            log.warning("epoch %d step %d: non-finite loss or gradient, step skipped (%d in a row); batch: %s",
                        progress.epoch, progress.step, progress.skipped_in_a_row, " ".join(fs.ids[i] for i in indices))
            if progress.skipped_in_a_row > t.max_skipped_steps:
                raise TrainingDiverged(
                    f"{progress.skipped_in_a_row} steps in a row had a non-finite loss or gradient in epoch "
                    f"{progress.epoch}; the run has diverged. Lower train.lr (now {t.lr:g}) or check the data; "
                    f"{RESULTS} and {CHECKPOINT} are as after epoch {progress.epoch - 1}")
            continue
        run.opt.step()
        progress.step += 1
        progress.skipped_in_a_row = 0
        total += summed
        count += len(indices)
        norms.append(grad_norm.item())
        tracker.log_step(progress.step, {"loss": summed / len(indices), "grad_norm": norms[-1], "lr": lr})
        bar.set_postfix(loss=f"{summed / len(indices):.3f}", refresh=False)
    return {"loss": total / count if count else math.nan, "utterances": count,
            "grad_norm_mean": sum(norms) / len(norms) if norms else math.nan,
            "grad_norm_max": max(norms, default=math.nan)}


def results_of(cfg: DictConfig, preset: str | None, run: Run, progress: Progress, status: str) -> dict:
    """results.json: the run's identity, its epochs, and the figures the report reads."""
    config, t = to_container(cfg), cfg.train
    times = [r["epoch_time_s"] for r in progress.history]
    stale = progress.epoch - progress.improved_epoch
    stop = progress.stop(t)
    return {
        "status": status, "preset": preset, "config": config, "rnn": config["model"]["rnn"],
        "bn": config["model"]["bn"], "impl": config["model"]["impl"], "seed": cfg.seed, "study": cfg.study,
        "epochs": progress.history, "best_epoch": progress.best_epoch, "best_val_wer": progress.best_val_wer,
        # "cap" or "floor" with an improvement inside the last patience window: still improving when it stopped
        "stop": stop, "improving_at_cap": stop in ("cap", "floor") and stale < max(t.patience, 1),
        # underfitting shows here: the training loss the tested model had, and how far the rate had fallen
        "train_loss_at_best": progress.history[progress.best_epoch - 1]["train_loss"] if progress.best_epoch else None,
        # the last epoch's, over train.lr
        "lr_at_stop": progress.history[-1]["lr"] / t.lr if progress.history else None,
        # the median epoch: one epoch slowed by a stray process (a test run, a laptop's sleep) moves it little
        "epoch_time_s": statistics.median(times) if times else None,
        "peak_mem_mb": max((r["peak_mem_mb"] for r in progress.history), default=None),
        "params": run.params, "device": run.device.type, "machine": machine(run.device), "bf16": run.bf16,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),  # train.threads 0: torch's default
        # data-parallel ranks, each with a share of every batch (not identity: N ranks train the same run)
        "world_size": distributed.world_size(),
        "recurrence_kernel": run.model.rnns[0].recurrence_kernel(run.device),
        # the conv front end's training BatchNorm + Hardtanh: "native" (layers.cpu_front_end) or torch's operations
        # (on a GPU, and under bf16 autocast, which runs them one by one)
        "front_end_kernel": cpu_front_end.kernel_name(run.device.type, torch.bfloat16 if run.bf16 else torch.float32),
        "skipped_steps": progress.skipped_steps, "ctc_skipped_utterances": run.ctc_skipped,
        "corpus": run.corpus_summary,
        "commit": code_commit(),  # the code that trained it: a study's report names its commits
    }


@functools.cache  # once a process: the code it loaded, even if the checkout moves on meanwhile
def code_commit(where: Path = Path(__file__).resolve().parent) -> str:
    """`git rev-parse HEAD` of the checkout `where` lies in (by default the one this package runs from), or
    "unknown" outside a git checkout (an installed wheel, a copied tree, no git). A study runs from a pinned
    checkout, so this is the study's commit."""
    try:
        found = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else "unknown"
