"""The corpus and its features.

- base.py: what every corpus is made of: Utterance, Corpus, the validation split, DataError.
- corpus.py: AN4 from its archive (download or local copy), checked, normalised and split; the audio reader.
- manifest.py: a corpus of your own from JSON-lines manifests (NeMo's convention), and AN4 written as them.
- text.py: the alphabet, transcript normalisation and CTC label encoding.
- features.py: log-mel or linear spectrogram features, cached per utterance set in a memory-mapped file, and
  length-bucketed batches.
- prepare.py: `python -m batchrnn.data`, which prepares a preset's corpus and features ahead of a study.
"""
