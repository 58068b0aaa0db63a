"""Word and character error rates over a whole split (errors summed over utterances, then divided)."""
import jiwer


def error_rates(refs: list[str], hyps: list[str]) -> tuple[float, float]:
    """(WER, CER) of hypotheses against non-empty references."""
    if not refs:
        return float("nan"), float("nan")
    return jiwer.wer(refs, hyps), jiwer.cer(refs, hyps)
