"""The output alphabet, transcript normalisation and greedy CTC decoding."""
import torch

BLANK = "_"
# Index 0 is the CTC blank, as in deepspeech.pytorch's labels file.
LABELS = [BLANK, "'", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", " "]
INDEX = {c: i for i, c in enumerate(LABELS)}


class TranscriptError(ValueError):
    """A transcript that cannot be written in the alphabet."""


def normalize(text: str) -> str:
    """Upper-case and squeeze whitespace; characters outside the alphabet are an error, not dropped."""
    text = " ".join(text.upper().split())
    bad = sorted({c for c in text if c not in INDEX or c == BLANK})
    if bad:
        raise TranscriptError(f"characters outside the alphabet: {''.join(bad)!r}")
    if not text:
        raise TranscriptError("empty transcript")
    return text


def encode(text: str) -> list[int]:
    return [INDEX[c] for c in text]


def decode(indices: list[int]) -> str:
    return "".join(LABELS[i] for i in indices)


def greedy_decode(logits: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Best path: argmax per frame, merge repeats, drop blanks. logits (T, N, C), lengths (N,)."""
    best = logits.argmax(-1).T.cpu()  # (N, T)
    texts = []
    for path, n in zip(best.tolist(), lengths.tolist()):
        path = path[:n]
        merged = [c for i, c in enumerate(path) if c != 0 and (i == 0 or c != path[i - 1])]
        texts.append(" ".join(decode(merged).split()))
    return texts
