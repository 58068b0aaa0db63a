"""The beam search with a word LM: torchaudio's CTC decoder (flashlight-text, KenLM inside) over the model's
log-probabilities, restricted to a lexicon's words. Here: the checks of decode.* a user can get wrong, the LM and
lexicon a run decodes with, and one decoder per (LM weight, word score).
"""
import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from batchrnn.config import ConfigError, DataConfig, DecodeConfig, Decoder
from batchrnn.data.base import Corpus, DataError
from batchrnn.data.text import BLANK, INDEX, LABELS, TranscriptError, normalize
from batchrnn.data.corpus import sha256
from batchrnn.decoding.lm import UNK, KneserNey, build
from batchrnn.errors import one_line

WORD_BREAK = "|"  # flashlight's silence token stands for the alphabet's space
TOKENS = [WORD_BREAK if c == " " else c for c in LABELS]
SPELLING = {c for c in INDEX if c not in (BLANK, " ")}  # what a lexicon's word may be made of


class DecodeError(ConfigError):
    """A decode.* setting, an LM or a lexicon that cannot work; the message names it and the fix."""


def check(cfg: DecodeConfig) -> None:
    """The settings' own errors, before any work: an LM with greedy decoding, an LM file that is not there or cannot
    be read, a lexicon with characters the model cannot emit, an empty grid."""
    if Decoder(cfg.decoder) is Decoder.greedy:
        if cfg.lm or cfg.lexicon:
            key, value = ("decode.lm", cfg.lm) if cfg.lm else ("decode.lexicon", cfg.lexicon)
            raise DecodeError(f"{key}={value}: greedy decoding uses no language model; add decode.decoder=beam, "
                              f"or drop {key}")
        return
    if cfg.lm:
        readable(cfg.lm, "decode.lm", "give a KenLM ARPA or binary file, or drop decode.lm to estimate a 3-gram from "
                                      "the training transcripts")
    if cfg.lexicon:
        lexicon_words(cfg.lexicon)
    if cfg.beam_size < 1:
        raise DecodeError(f"decode.beam_size={cfg.beam_size}: must be 1 or more")
    if not cfg.lm_weights or not cfg.word_scores:
        raise DecodeError("decode.lm_weights and decode.word_scores: the tuning grid needs at least one value each")
    for key, values in (("decode.lm_weights", cfg.lm_weights), ("decode.word_scores", cfg.word_scores)):
        if len(set(values)) < len(values):
            raise DecodeError(f"{key}={list(values)}: a value twice; give each value once")
    if cfg.widen < 0:
        raise DecodeError(f"decode.widen={cfg.widen}: must be 0 or more (0: the grid as given)")


def readable(path: str, key: str, fix: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise DecodeError(f"{key}={path}: {e.strerror.lower() if e.strerror else one_line(e)}; {fix}") from e


def lexicon_words(path: str) -> list[str]:
    """The words of a lexicon file: each line's first field (flashlight's "WORD W O R D |" lines also work)."""
    readable(path, "decode.lexicon", "give a file of words, one a line, or drop decode.lexicon to use the training "
                                     "words")
    words = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.split():
            continue
        word = line.split()[0]
        if bad := sorted(set(word) - SPELLING):
            raise DecodeError(f"decode.lexicon={path}:{number}: {word!r} has characters outside the model's alphabet "
                              f"({''.join(bad)!r}); the model spells with {''.join(sorted(SPELLING))!r}: correct or "
                              "delete the line")
        words.append(word)
    if not words:
        raise DecodeError(f"decode.lexicon={path}: no words; give a file of words, one a line")
    return sorted(set(words))


def lm_sentences(data: DataConfig, corpus: Corpus) -> list[str]:
    """What the built LM is estimated from: data.lm_text's lines, normalised as transcripts are, or else the training
    split's transcripts. Never validation's or test's."""
    if not data.lm_text:
        return [u.text for u in corpus.splits["train"]]
    try:
        lines = Path(data.lm_text).read_text().splitlines()
    except OSError as e:
        raise DataError(f"data.lm_text={data.lm_text}: {one_line(e)}; give a text file, one sentence a line") from e
    sentences = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                sentences.append(normalize(line))
            except TranscriptError as e:
                raise DataError(f"{data.lm_text}:{number}: {e}; correct or delete the line") from e
    if not sentences:
        raise DataError(f"data.lm_text={data.lm_text}: no sentences; give a text file, one sentence a line")
    return sentences


@dataclass
class LanguageModel:
    path: Path  # ARPA or KenLM binary
    sha256: str  # of the file: how results.json and the report name it
    words: list[str]  # the lexicon: what the search may emit
    built: bool  # estimated here (from the training transcripts or data.lm_text), not the user's own

    @property
    def name(self) -> str:
        return f"{self.path.name} (sha256 {self.sha256[:16]})"

    def key(self) -> str:
        """What the hypotheses depend on besides the model and the search: the LM's content and the lexicon."""
        return hashlib.sha256(f"{self.sha256} {' '.join(self.words)}".encode()).hexdigest()[:16]


def language_model(cfg: DecodeConfig, data: DataConfig, corpus: Corpus) -> LanguageModel:
    """decode.lm, or the 3-gram of the training transcripts built on first use under the corpus's folder; with
    decode.lexicon's words, or else the words of the text it was estimated from."""
    sentences = None
    if cfg.lm:
        path = Path(cfg.lm)
    else:
        sentences = lm_sentences(data, corpus)
        path = build(sentences, corpus.root / "lm")
    if cfg.lexicon:
        words = lexicon_words(cfg.lexicon)
    else:
        words = KneserNey(sentences).vocab if sentences else sorted({w for u in corpus.splits["train"]
                                                                     for w in u.text.split()})
    return LanguageModel(path, sha256(path), words, built=not cfg.lm)


class BeamSearch:
    """The model's emissions to words, at one beam size, for any (LM weight, word score) of the grid."""

    def __init__(self, lm: LanguageModel, beam_size: int):
        self.lm, self.beam_size = lm, beam_size
        self._dir = tempfile.TemporaryDirectory(prefix="batchrnn-lexicon-")
        self.lexicon = Path(self._dir.name) / "lexicon.txt"
        self.lexicon.write_text("".join(f"{w}\t{' '.join(w)} {WORD_BREAK}\n" for w in lm.words))

    def decoder(self, lm_weight: float, word_score: float):
        from torchaudio.models.decoder import ctc_decoder  # loads flashlight-text: only where a beam is asked for

        try:
            with quiet_stderr():  # KenLM draws a progress bar on every load, 28 of them in a tuning
                return ctc_decoder(lexicon=str(self.lexicon), tokens=TOKENS, lm=str(self.lm.path),
                                   beam_size=self.beam_size, lm_weight=lm_weight, word_score=word_score,
                                   blank_token=BLANK, sil_token=WORD_BREAK, unk_word=UNK)
        except (RuntimeError, ValueError) as e:  # KenLM's refusal of a file that is not a language model
            why = str(e).strip().splitlines()[-1]  # KenLM's first line is where in its source it threw
            raise DecodeError(f"decode.lm={self.lm.path}: KenLM cannot read it ({why}); give a KenLM ARPA or binary "
                              "file") from e

    def __call__(self, emissions: list[torch.Tensor], lm_weight: float, word_score: float) -> list[str]:
        """Each utterance's best word sequence; emissions: log-probabilities, each (T, classes)."""
        decoder = self.decoder(lm_weight, word_score)
        texts = []
        for e in emissions:
            best = decoder(e[None].float().contiguous(), torch.tensor([e.shape[0]]))[0]
            texts.append(" ".join(best[0].words) if best else "")
        return texts


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null while KenLM, C++ code that writes there directly, loads; its errors come back
    as exceptions, whose message the caller reports."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
