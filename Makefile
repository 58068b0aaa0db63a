# `make help` lists the targets. Every target installs the virtual environment first if needed.
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)
SWEEP ?= runs/an4_cpu_plateau

.PHONY: help venv test test-slow smoke reproduce-an4 reproduce-depth reproduce-norms studies patience-study patience-decode patience-finish report bench gpu-check clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml src/batchrnn/layers/csrc/onednn_gru.cpp src/batchrnn/layers/csrc/front_end.cpp
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m batchrnn.layers.build --allow-fallback
	rm -f .venv/.installed-* && touch $@

venv: $(STAMP) ## create .venv and install the package with its dev extras

test: $(STAMP) ## the fast test suite (no GPU, no real corpus)
	$(PY) -m pytest

test-slow: $(STAMP) ## the slow lane: the real AN4 archive (AN4_ARCHIVE=path) and longer runs
	$(PY) -m pytest -m slow

smoke: $(STAMP) ## one tiny run on a generated corpus, under a minute
	$(PY) src/run.py experiment=smoke

reproduce-an4: $(STAMP) ## AN4, the README's table: grid and norms, seeds 1-3, LSTM seeds 1-6, converged protocol, the report; ARGS=hydra/launcher=parallel; SCHEDULE=exponential: the earlier grid
	bash experiments/reproduce_an4.sh grid $(ARGS)

reproduce-depth: $(STAMP) ## DS2 Table 1's design: 1,3,5,7 layers x none,seqwise x SEEDS, the report (runs/an4_depth_plateau)
	bash experiments/reproduce_an4.sh depth $(ARGS)

reproduce-norms: $(STAMP) ## layer and weight norm (ln, wn, ln_full) beside the grid, same protocol and folder
	bash experiments/reproduce_an4.sh norms $(ARGS)

studies: $(STAMP) ## every protocol study as one schedule, resumable: the grid, the normalisations, LSTM seeds 4-6, the depth study
	bash experiments/reproduce_an4.sh all $(ARGS)

# issue 52's study (docs/protocol.md, "The patience study"): every variant of grid and norms, six seeds fixed in the preset
PATIENCE := experiment=an4_cpu_patience model.rnn=gru,lstm model.bn=none,post,input,skip,seqwise,ln,ln_full,wn hydra/launcher=parallel
patience-study: ## the patience study from a checkout pinned to COMMIT (default HEAD) in DIR (../study-patience), in the background; run again to resume
	bash experiments/pinned_study.sh $(or $(COMMIT),HEAD) $(or $(DIR),../study-patience) -- $(PATIENCE)

patience-decode: $(STAMP) ## at a session's end, the patience study stopped: finished runs decoded with the LM while best.pt is here
	$(PY) experiments/finish_study.py $(or $(DIR),../study-patience) --decode-ended

patience-finish: $(STAMP) ## after the patience study's last run: verdict runs without best.pt trained again, LM decoding, results kept, report
	$(PY) experiments/finish_study.py $(or $(DIR),../study-patience) --rows 16 -- \
	    --inference experiments/results/inference/an4_cpu_plateau_b1_t1.jsonl

report: $(STAMP) ## rebuild report.md and plots from a sweep folder (SWEEP, default runs/an4_cpu_plateau) [ARGS=--wandb]
	$(PY) -m batchrnn.report $(SWEEP) $(ARGS)

bench: $(STAMP) ## time and memory of every variant vs bn=none, about 3 minutes on 2 cores; ARGS=--quick: 10-20 s
	$(PY) experiments/bench_rnn.py $(ARGS)

gpu-check: $(STAMP) ## the GPU path in <= 8 min on one GPU: pytest -m gpu, bench, 2 epochs of an4_gpu (ARGS=--dry-run: CPU)
	$(PY) experiments/gpu_check.py $(ARGS)

clean: ## remove the virtual environment (keeps data/ and runs/)
	rm -rf .venv
