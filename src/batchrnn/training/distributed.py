"""Data-parallel training: N processes (ranks) that compute exactly what one process computes.

Each rank takes its share of every batch; BatchNorm's masked moments, the loss, the skip decision and the
scores are summed over the ranks (gloo on the CPU, NCCL on CUDA). Started by torchrun (RANK, WORLD_SIZE, ... in
the environment) or by submitit with several tasks per job. With one process nothing here communicates or
rescales: every helper hands its input back as it is.
"""
import atexit
import contextlib
import datetime
import fcntl
import functools
import gc
import os
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

from batchrnn.config import BNMode, ConfigError

_ghost = False  # this rank runs a batch with no utterance of its own (a share of nothing): its sums count 0
_abandoned = False  # a run's work raised: a collective may still wait on another rank (leave)
HELD = "the process group is still held at exit"  # leave()'s warning: a wrapped model outlives its run


class DistributedError(RuntimeError):
    """A rank stopped answering (the process group's timeout) or vanished; the message names the fix."""


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def local_world_size() -> int:
    """Ranks on this machine, which share its cores (train.threads=0)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def lead() -> bool:
    """Rank 0, which alone holds the run folder's lock and writes its files."""
    return rank() == 0


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def from_submitit() -> None:
    """Inside a submitit job of several tasks (hydra.launcher.tasks_per_node), torch's env:// variables set
    from the job's environment. CUDA_VISIBLE_DEVICES is left as it is: each rank takes GPU LOCAL_RANK."""
    if os.environ.get("SUBMITIT_EXECUTOR") and "RANK" not in os.environ:
        import submitit

        if submitit.JobEnvironment().num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def check(cfg) -> None:
    """What several ranks cannot compute as one process does; a ConfigError before any work."""
    if world_size() == 1:
        return
    if BNMode(cfg.model.bn) is BNMode.rbn:
        raise ConfigError(f"model.bn=rbn with {world_size()} ranks: its per-time-step moments are not synchronised "
                          "across ranks; train rbn in one process")
    sa = cfg.train.spec_augment
    if sa.enabled and sa.freq_masks + sa.time_masks > 0 and not sa.per_utterance:
        raise ConfigError(f"train.spec_augment.per_utterance=false with {world_size()} ranks: its masks come from "
                          "each process's random stream, so the ranks would not draw what one process draws; set "
                          "train.spec_augment.per_utterance=true")


def start(device: torch.device, timeout_s: float) -> torch.device:
    """Joins the process group (once per process) and returns this rank's device: cuda:LOCAL_RANK on CUDA."""
    if world_size() == 1:
        return device
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(leave)
    return device


def abandon() -> None:
    """A run's work raised (an error, a signal): at exit, leave the process group without waiting for it."""
    global _abandoned
    _abandoned = True


def leave() -> bool:
    """Leaves the process group and ends its worker threads while the interpreter still runs (at exit: start()
    registers it). True when the group is gone, its threads joined; after abandon(), it only leaves.

    A gloo worker thread frees the tensors of a collective after the rank's wait for it has returned, and freeing a
    tensor that Python has seen takes the GIL. Were that the last collective of a process that then exits, the
    thread could ask for the GIL while the interpreter finalizes; CPython ends such a thread with pthread_exit,
    whose unwinding through a noexcept destructor calls std::terminate: SIGABRT, "terminate called without an
    active exception", after the run's work is done (rank 1 of the gradient test here: 2 runs in 16).
    destroy_process_group() alone does not end gloo's threads: they end when the group is freed, and a run's
    DistributedDataParallel wrapper, whose reducer holds the group, sits in reference cycles that only a collection
    frees."""
    if not dist.is_initialized():
        return True
    if _abandoned:  # a queued collective may wait on a rank that is gone or stuck, up to the timeout: not for that
        dist.destroy_process_group()
        return False
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    gc.collect()  # the group's destructor releases the GIL, waits for its queue and joins its threads
    if group() is None:
        return True
    print(f"batchrnn: rank {rank()}: {HELD} (a DistributedDataParallel model outlives its run); waiting 0.5 s for "
          "its threads", file=sys.stderr)
    time.sleep(0.5)  # let a collective's in-flight frees take the GIL before the interpreter finalizes
    return False


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel around the model with several ranks (the model itself with one). Buffers are not
    broadcast: BatchNorm's running moments follow the synchronised batch moments, equal on every rank."""
    if not active():
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def share(indices: list[int]) -> list[int]:
    """This rank's utterances of a batch, strided (each rank gets short and long ones alike). Empty where the
    batch has fewer utterances than there are ranks."""
    return indices[rank()::world_size()] if active() else indices


@contextlib.contextmanager
def ghost(on: bool):
    """While on, this rank's sums count nothing: it runs a stand-in utterance so that it takes part in every
    collective of the forward, and its loss is weighted 0 (share_loss)."""
    global _ghost
    _ghost = on and active()
    try:
        yield
    finally:
        _ghost = False


def ghosting() -> bool:
    """Whether this rank runs a stand-in now (ghost): a custom backward through all_sum's moments passes x nothing."""
    return _ghost


def all_sum(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor summed over the ranks, in one all-reduce; differentiable (the backward all-reduces the gradient,
    so the backward through synchronised moments is one process's too). With one process, the tensors as given."""
    if not active():
        return list(tensors)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    if _ghost:
        flat = flat * 0
    out = all_reduce_with_grad(flat)
    pieces = out.split([t.numel() for t in tensors])
    return [p.view(t.shape).to(t.dtype) for p, t in zip(pieces, tensors)]


def share_loss(loss: torch.Tensor, mine: int, total: int) -> torch.Tensor:
    """The loss whose gradient, averaged by DDP over the ranks, is the whole batch's mean loss's: the share's
    mean weighted by its part of the batch's utterances, times the world size that DDP divides by."""
    if not active():
        return loss
    return loss * (mine * dist.get_world_size() / total)


def batch_loss(loss: torch.Tensor, mine: int) -> tuple[float, bool]:
    """(the batch's loss summed over its utterances, whether it is finite on every rank): one all-reduce."""
    if not active():
        return loss.item() * mine, bool(torch.isfinite(loss))
    local = torch.stack([loss.detach().double() * mine, (~torch.isfinite(loss)).double()])
    dist.all_reduce(local)
    return local[0].item(), local[1].item() == 0


def agree(finite: torch.Tensor) -> bool:
    """Whether a flag (a finite gradient norm) holds on every rank, so that every rank skips the same steps."""
    if not active():
        return bool(finite)
    bad = (~finite.detach().bool()).double().reshape(1)
    dist.all_reduce(bad)
    return bad.item() == 0


def total(value: float) -> float:
    """A float summed over the ranks (a loss sum, a count)."""
    return reduced(value, "SUM")


def largest(value: float) -> float:
    """The largest of the ranks' values (peak memory: the rank that needs the most)."""
    return reduced(value, "MAX")


def reduced(value: float, op: str) -> float:
    if not active():
        return value
    backend = dist.get_backend()
    t = torch.tensor([value], dtype=torch.float64,
                     device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu")
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.item()


def merged(found: dict) -> dict:
    """The union of every rank's dict (each rank's hypotheses of its own utterances)."""
    if not active():
        return found
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, found)
    return {k: v for part in parts for k, v in part.items()}


def broadcast(value):
    """Rank 0's value (any picklable object) on every rank."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def one_at_a_time(folder: Path):
    """The processes that share a data folder (the ranks on a machine, a parallel sweep's jobs), one at a time
    inside: the corpus and its feature cache are prepared by the first and read by the others. A file lock, not a
    barrier: preparing a corpus may take longer than the process group's timeout. Where the folder cannot be made
    or locked, nothing is held, and preparing the corpus says what is wrong with the folder."""
    with contextlib.ExitStack() as held:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            handle = held.enter_context(open(Path(folder) / ".prepare.lock", "a"))
            fcntl.flock(handle, fcntl.LOCK_EX)  # released as the file closes
        except OSError:  # a read-only folder, a filesystem without flock (some NFS)
            pass
        yield


def unanswered(e: BaseException, timeout_s: float) -> DistributedError | None:
    """The DistributedError for a collective that failed (a rank timed out or vanished), else None."""
    text = str(e)
    signs = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
    if world_size() == 1 or not isinstance(e, RuntimeError) or not any(w in text.lower() for w in signs):
        return None
    return DistributedError(
        f"rank {rank()} of {world_size()}: another rank did not answer within train.dist_timeout_s={timeout_s:g} s "
        f"or has gone ({text.strip().splitlines()[0][:160]}); every rank stops. Run the same command again to resume "
        "from the last complete epoch; raise train.dist_timeout_s if a rank is only slow")
