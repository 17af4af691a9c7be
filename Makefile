# One environment for everything: a local virtualenv with the pinned CPU build of torch.
# GPU users: `make install TORCH_SPEC="torch==<your CUDA build>"` or pip install -e . yourself.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install native demo test test-slow test-gpu bench-step bench-quick bench-state-size benchmarks soak \
	vendor docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# the pinned CPU wheel first, so the range in pyproject never pulls a CUDA build; numpy
	# beside it, since the CPU wheel does not require it but warns at import without it
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q -e ".[test]"
	touch $@

# the forwarding backend torch process groups of user scripts run on: compiled once per
# machine and source (about a minute on two cores); a launch builds it too if it is missing
native: install
	$(BIN)/python -m trainmover.comm.native

demo: install
	$(BIN)/trainmover demo

test: native
	$(BIN)/python -m pytest -q

test-slow: native
	$(BIN)/python -m pytest -q -m slow

# On a GPU machine whose python already has a CUDA build of torch (no venv, no network):
# each worker on its own GPU over NCCL where there are enough, else GPUs shared over gloo.
test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -q -s -m gpu tests/test_gpu.py

bench-step: install
	$(BIN)/trainmover bench step

# The headline cells in minutes on 2 cores: a planned migration, a crash recovery and a
# stop-and-restart from a checkpoint (4 workers, eager, 3 repeats; median, min, max) into
# benchmarks/results/quick.md and quick.json, then the cluster-scale projection from them
# (projection-quick.md: the same `trainmover project` as `make benchmarks` runs).
bench-quick: install
	$(BIN)/trainmover bench quick
	$(BIN)/trainmover project --bench benchmarks/results/quick.json --name projection-quick

# Downtime against the state a worker holds: a planned migration and a crash recovered from
# a data-parallel replica at about 10 MB, 100 MB, 500 MB and 2 GB of parameters and AdamW
# moments per worker (DP2 + one standby, 3 repeats) into benchmarks/results/state_size.md
# and state_size.json. The 2 GB size needs about 15 GiB of free memory (a size that does not
# fit is reported as such, not run); an hour or more on 2 cores.
bench-state-size: install
	$(BIN)/trainmover bench state-size

# Every result the README quotes, regenerated from the code as it is into benchmarks/results
# (each file names the machine, the commit, the command and its settings). Hours on 2 cores;
# not in CI. `bench hosts` needs root (network namespaces); the soak is `make soak`. The
# downtime files: eager (4, 8 and 16 workers) and compiled (4 and 8); the projection reads
# the eager pair (every strategy, the naive migration's cold join included) and the control
# plane's costs against N (bench control, the sizes this machine reaches; a step's vote
# through vote groups to 12,500 hosts). bench-quick first.
benchmarks: install bench-quick
	$(BIN)/trainmover bench step
	$(BIN)/trainmover bench downtime --workers 4,8,16 --scenarios planned --no-compile \
		--name downtime-eager
	$(BIN)/trainmover bench downtime --workers 4,8 --scenarios crash,hang --no-compile \
		--name downtime-failures-eager
	$(BIN)/trainmover bench downtime --workers 4,8 --scenarios planned \
		--name downtime-compiled
	$(BIN)/trainmover bench downtime --workers 4,8 --scenarios crash,hang \
		--name downtime-failures-compiled
	$(BIN)/trainmover bench control --workers 256,512,1024,2048 --name control_scaling
	$(BIN)/trainmover bench control --workers 4096 --health.silence_floor_s=5 \
		--name control_4096
	$(BIN)/trainmover bench control --workers 1024,2048,4096 --sim-procs 2 \
		--health.silence_floor_s=5 --name control_groups
	$(BIN)/python benchmarks/vote_hosts.py --hosts 128,512,2048,12500 --spread-ms 0,20 \
		--out benchmarks/results --name vote_hosts
	$(BIN)/python benchmarks/vote_groups.py --hosts 16,32,64,128,512,2048,12500 \
		--out benchmarks/results --name vote_groups
	$(BIN)/trainmover project --bench benchmarks/results/downtime-eager.json \
		--bench benchmarks/results/downtime-failures-eager.json \
		--control benchmarks/results/control_groups.json \
		--vote-hosts benchmarks/results/vote_groups.json
	$(BIN)/trainmover bench checkpoint
	$(BIN)/trainmover bench sources
	$(BIN)/trainmover bench straggler --json benchmarks/results/straggler_results.json
	$(BIN)/trainmover bench false-positives
	$(BIN)/trainmover bench ettr --minutes 10 --every 60 --standbys 10 --no-replenish \
		--name ettr_10min --json benchmarks/results/ettr_results.json
	$(BIN)/trainmover bench view
	$(BIN)/trainmover bench example
	$(BIN)/trainmover bench hosts
	$(BIN)/python benchmarks/store_keys.py --steps 10000 --every 1000

# Not in CI: a 30-minute job disrupted every ~20 s, then run again without events
# (benchmarks/results/soak.md). SOAK_MINUTES=5 for a shorter one.
SOAK_MINUTES ?= 30
soak: install
	$(BIN)/trainmover bench soak --minutes $(SOAK_MINUTES)

# The dashboard's chart library, from the npm registry, vendored into the package (committed:
# a running job serves it, offline). Pinned by version and the tarball's sha256.
UPLOT_VERSION ?= 1.6.32
UPLOT_SHA256 ?= 4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d
vendor:
	rm -rf .vendor && mkdir .vendor
	cd .vendor && npm pack -q uplot@$(UPLOT_VERSION) >/dev/null && \
		echo "$(UPLOT_SHA256)  uplot-$(UPLOT_VERSION).tgz" | sha256sum -c - && \
		tar xzf uplot-$(UPLOT_VERSION).tgz
	cp .vendor/package/dist/uPlot.iife.min.js .vendor/package/dist/uPlot.min.css \
		trainmover/view/static/vendor/
	cp .vendor/package/LICENSE trainmover/view/static/vendor/uPlot.LICENSE
	rm -rf .vendor

# The documentation site (mkdocs.yml) into site/; the reference pages are generated from the
# code as it builds. NO_MKDOCS_2_WARNING: mkdocs-material's banner about MkDocs 2.0.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs site .pytest_cache
