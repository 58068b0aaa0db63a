"""Alphabet, transcript normalisation, greedy CTC decoding and error rates on hand-worked cases."""
import pytest
import torch

from batchrnn.metrics import error_rates
from batchrnn.data.text import LABELS, TranscriptError, encode, greedy_decode, normalize


def test_labels_blank_apostrophe_letters_space():
    assert LABELS[0] == "_" and LABELS[1] == "'" and LABELS[2] == "A" and LABELS[-1] == " "
    assert len(LABELS) == 29


def test_normalize():
    assert normalize("  yes   no ") == "YES NO"
    assert normalize("Yes, no. \u201cDon\u2019t!\u201d") == "YES NO DON'T"  # sentence punctuation is a word break
    for text, bad in [("YES 42", "'24'"), ("TWENTY-ONE", "'-'"), ("NA\u00cfVE", "'\u00cf'")]:
        with pytest.raises(TranscriptError, match=f"outside the alphabet: {bad}"):
            normalize(text)
    with pytest.raises(TranscriptError, match="empty"):
        normalize("   ")


def one_hot_path(path: list[int]) -> torch.Tensor:
    logits = torch.full((len(path), 1, len(LABELS)), -10.0)
    for t, c in enumerate(path):
        logits[t, 0, c] = 10.0
    return logits


def test_greedy_decode_merges_repeats_and_drops_blanks():
    a, b, space = encode("A")[0], encode("B")[0], encode(" ")[0]
    # A A _ A B B _ _ space space B  ->  "AA B"... blank separates the repeated A
    path = [a, a, 0, a, b, b, 0, 0, space, space, b]
    assert greedy_decode(one_hot_path(path), torch.tensor([len(path)])) == ["AAB B"]
    # frames past the length are ignored
    assert greedy_decode(one_hot_path(path), torch.tensor([2])) == ["A"]


def test_error_rates_hand_worked():
    # ref 5 words; "A C" deletes B, "" deletes D and E: 3 / 5
    wer, cer = error_rates(["A B C", "D E"], ["A C", ""])
    assert wer == pytest.approx(0.6)
    # characters: "A B C" -> "A C" deletes "B " (2 of 5); "D E" -> "" deletes 3 of 3: 5 / 8
    assert cer == pytest.approx(5 / 8)
    assert error_rates(["THREE NINE"], ["TREE NINE"]) == pytest.approx((0.5, 0.1))
