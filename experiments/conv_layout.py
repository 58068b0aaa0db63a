"""The conv front end's two convolutions (an4_cpu's: 1->32 channels 11x11 stride 2, then 32->32 7x7 stride 2, on
16 utterances of 64 mel bands x 201 frames), forward and backward at 1 thread, in torch's default layout and in
channels_last, interleaved, median of 10 rounds after 2 warm-up rounds (issue 50's lead: the convolutions are about
a fifth of a gru-none step).

    python experiments/conv_layout.py
"""
import statistics
import time

import torch
from torch import nn

N, F, T = 16, 64, 201  # an AN4 training batch's shape (epoch 2's first)
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    convs = [nn.Conv2d(1, 32, (11, 11), (2, 2), (5, 5)), nn.Conv2d(32, 32, (7, 7), (2, 2), (3, 3))]
    x = torch.randn(N, 1, F, T)
    times = {name: [] for name in LAYOUTS}
    for _ in range(12):
        for name, layout in LAYOUTS.items():
            for conv in convs:
                conv.to(memory_format=layout)
            start = time.perf_counter()
            y = convs[1](torch.relu(convs[0](x.contiguous(memory_format=layout))))
            y.sum().backward()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["contiguous"][2:])
    for name, t in times.items():
        print(f"{name:14} {1000 * statistics.median(t[2:]):6.1f} ms  x{statistics.median(t[2:]) / base:.2f}")


if __name__ == "__main__":
    main()
