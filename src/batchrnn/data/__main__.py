"""python -m batchrnn.data: prepare the corpus (and with --features, a preset's features) ahead of a study."""
from batchrnn.data.prepare import AGAIN, main
from batchrnn.training import stopping

stopping.install(AGAIN)  # SIGTERM: one line and exit status 143, as a run stops (Ctrl-C: main)
main()
