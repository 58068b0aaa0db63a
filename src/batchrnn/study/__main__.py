"""python -m batchrnn.study: run a study under the fair protocol (batchrnn.study.scheduler)."""
from batchrnn.study.scheduler import main

main()
