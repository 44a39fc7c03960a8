# Fresh-machine entry points: `make demo` (main job) and `make test` (test suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/pip install -q -e ".[examples]"
	$(BIN)/python examples/gpt2/finetune.py --steps 20 --out runs/gpt2

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install -q -e ".[examples]"
	$(BIN)/python benchmarks/bench_dp.py
	$(BIN)/python benchmarks/bench_sequential.py
	$(BIN)/python benchmarks/bench_plan.py

clean:
	rm -rf $(VENV) .pytest_cache
