"""Where a run computes and how its cost is measured: device choice, autocast, clocks, peak memory."""
import platform
import re
import resource
from pathlib import Path

import torch

from batchrnn.config import ConfigError, Device, TrainConfig, cpu_has_native_bf16


def pick_device(choice: Device) -> torch.device:
    if Device(choice) is Device.cuda and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available; use train.device=auto or cpu")
    if Device(choice) is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def uses_bf16(t: TrainConfig, device: torch.device) -> bool:
    """bf16 autocast: on CUDA with train.amp; on the CPU only when asked (train.cpu_bf16) and native."""
    if device.type == "cuda":
        return bool(t.amp)
    if t.cpu_bf16 and not cpu_has_native_bf16():
        raise ConfigError("train.cpu_bf16=true: this CPU has no native bf16 (no avx512_bf16 or amx_bf16 in "
                          "/proc/cpuinfo), where bf16 is emulated, slower and changes the numbers; drop it")
    return bool(t.cpu_bf16)


def machine(device: torch.device) -> str:
    """What ran the epochs, to tell whether two runs' times can be compared: host, CPU or GPU model, and
    the boot (virtual machines of one image share host name and CPU string, not their speed)."""
    if device.type == "cuda":
        model = torch.cuda.get_device_name(device)
    else:
        try:
            model = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1]
        except (OSError, StopIteration):
            model = platform.processor() or platform.machine()
    try:
        boot = " (boot " + Path("/proc/sys/kernel/random/boot_id").read_text()[:8] + ")"
    except OSError:
        boot = ""
    return f"{platform.node()}: {model.strip()}{boot}"


def synchronize(device: torch.device) -> None:
    """Before reading a clock: CUDA kernels run asynchronously."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
