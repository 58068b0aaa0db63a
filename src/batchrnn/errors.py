"""Helpers for errors the user reads: every module that reports one imports them from here."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message: torch and tarfile write paragraphs, our errors are one line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(":")
