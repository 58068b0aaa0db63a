"""Decoding a trained model's output: greedy (batchrnn.data.text) or a beam search with a word language model."""
