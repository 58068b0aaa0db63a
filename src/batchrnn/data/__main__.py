"""python -m batchrnn.data: prepare the corpus (and with --features, a preset's features) ahead of a study."""
from batchrnn.data.prepare import main

main()
