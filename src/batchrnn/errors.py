"""Helpers for errors the user reads: every module that reports one imports them from here."""
import errno


def one_line(e: BaseException) -> str:
    """The first line of an exception's message: torch and tarfile write paragraphs, our errors are one line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(":")


DIVERGED = 3  # the exit status of a run, sweep or study in which some runs diverged (which the protocol counts)


def worst(a: int, b: int) -> int:
    """Of two exit statuses, the one that says more: 0 (all well) < 3 (some runs diverged) < anything else
    (a user error, a damaged run folder, a crash), the larger of those."""
    return max(a, b, key=lambda c: (c not in (0, DIVERGED), c))


# OSErrors the user can fix: a full disk, or a folder this process may not write in; each with its fix. Any other
# OSError is a bug or a vanished file, whose traceback says more.
WRITE_FIXES = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space within your disk quota",
               errno.EROFS: "choose a folder on a writable filesystem",
               errno.EACCES: "make the folder writable, or choose another",
               errno.EPERM: "make the folder writable, or choose another"}


def cannot_write(e: OSError, path=None) -> str | None:
    """'PATH: No space left on device; free space on that disk' for an OSError the user can fix (WRITE_FIXES),
    naming path (else the file the error names); None for any other."""
    fix = WRITE_FIXES.get(e.errno)
    return f"{path or e.filename}: {e.strerror}; {fix}" if fix else None
