"""Progress bars: tqdm's on a terminal, plain lines in a log file.

Under nohup, in CI or in a SLURM log, a bar's carriage-return redraws pile up as thousands of fragments.
When stderr is not a terminal, a bar writes one whole line every LOG_INTERVAL_S seconds instead (and its
last state when it ends, if it is kept), in ASCII.
"""
import sys

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


class Lines:
    """A stream for tqdm that turns its redraws into whole lines and drops the blank ones that clear a bar."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs), writing lines rather than a redrawn bar where stderr is not a terminal."""
    stream = kwargs.pop("file", None) or sys.stderr
    if not stream.isatty():
        kwargs.update(file=Lines(stream), ascii=True, mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S,
                      ncols=100)
    else:
        kwargs["file"] = stream
    return tqdm(iterable, **kwargs)
