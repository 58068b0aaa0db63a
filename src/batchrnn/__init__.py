"""batchrnn: where to put BatchNorm in a DeepSpeech2 recurrent stack, and what it costs."""
