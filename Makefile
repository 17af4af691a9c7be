# One environment for everything: a local virtualenv with the pinned CPU build of torch.
# GPU users: `make install TORCH_SPEC="torch==<your CUDA build>"` or pip install -e . yourself.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test test-slow test-gpu bench-step soak clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# the pinned CPU wheel first, so the range in pyproject never pulls a CUDA build; numpy
	# beside it, since the CPU wheel does not require it but warns at import without it
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: install
	$(BIN)/trainmover demo

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# On a GPU machine whose python already has a CUDA build of torch (no venv, no network):
# each worker on its own GPU over NCCL where there are enough, else GPUs shared over gloo.
test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -q -s -m gpu tests/test_gpu.py

bench-step: install
	$(BIN)/trainmover bench step

# Not in CI: a 30-minute job disrupted every ~20 s, then run again without events
# (benchmarks/results/soak.md). SOAK_MINUTES=5 for a shorter one.
SOAK_MINUTES ?= 30
soak: install
	$(BIN)/trainmover bench soak --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) runs .pytest_cache
