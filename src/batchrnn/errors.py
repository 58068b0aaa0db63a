"""Helpers for errors the user reads: every module that reports one imports them from here."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message: torch and tarfile write paragraphs, our errors are one line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(":")


DIVERGED = 3  # the exit status of a run, sweep or study in which some runs diverged (which the protocol counts)


def worst(a: int, b: int) -> int:
    """Of two exit statuses, the one that says more: 0 (all well) < 3 (some runs diverged) < anything else
    (a user error, a damaged run folder, a crash), the larger of those."""
    return max(a, b, key=lambda c: (c not in (0, DIVERGED), c))
