"""The output alphabet, transcript normalisation and greedy CTC decoding."""
import torch

BLANK = "_"
# Index 0 is the CTC blank, as in deepspeech.pytorch's labels file.
LABELS = [BLANK, "'", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", " "]
INDEX = {c: i for i, c in enumerate(LABELS)}


class TranscriptError(ValueError):
    """A transcript that cannot be written in the alphabet."""


# Sentence punctuation is never spoken, so it becomes a word break ("yes, no." -> "YES NO"); a typographic
# apostrophe is the alphabet's. Anything else outside the alphabet (digits, hyphens, accented letters)
# needs a decision about what was said, so it is refused rather than guessed.
SAFE = str.maketrans({**{c: " " for c in '.,?!;:"\u201c\u201d'}, "\u2018": "'", "\u2019": "'"})


def normalize(text: str) -> str:
    """Upper-case, sentence punctuation to spaces, whitespace squeezed; other characters outside the
    alphabet are an error, never dropped."""
    text = " ".join(text.translate(SAFE).upper().split())
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
