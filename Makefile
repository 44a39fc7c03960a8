# Fresh-machine entry points: `make demo` (main job) and `make test` (test suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-slow test-fast test-compat bench bench-extra clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,examples]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python examples/gpt2/finetune.py --steps 20 --out runs/gpt2

# The import-linter contracts first (pyproject.toml: layers, the torch-free side, no cycles), then the
# suite on two workers (pytest-xdist; tests/conftest.py shares the cores among them): about 16 min on 2 cores.
# Tests marked slow (variants of what the suite already checks) are skipped there; `make test-slow` runs them.
test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4

# The solvers against their oracles (DP brute force, ILP exhaustive search), the operators and variants, the cache and
# the docs: about a minute on 2 cores, for development.
FAST_TESTS = tests/test_dp.py tests/test_ilp.py tests/test_budget_and_schedule.py tests/test_variants.py \
	tests/test_linear.py tests/test_in_place.py tests/test_cache.py tests/test_docs.py

test-slow: setup
	HIERREMAT_RUN_SLOW=1 $(BIN)/python -m pytest -q -n auto --maxprocesses=4 -m slow

test-fast: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 $(FAST_TESTS)

# The ends of the torch range pyproject.toml declares (hierremat/_torch_version.py), each in a venv of its own
# (CUDA builds from PyPI: several GB each): the fast tier and the capture, planning and training tests.
# Where a pip config caps torch below the range's newest (a constraints file), run it with PIP_CONFIG_FILE=/dev/null.
COMPAT_TORCH ?= 2.11.0 2.15.0
COMPAT_TESTS = $(FAST_TESTS) tests/test_whole_model.py tests/test_sequential.py tests/test_hf_models.py \
	tests/test_meta.py tests/test_boundary_writes.py tests/test_shapes.py tests/test_torch_version.py

.venv-torch-%/bin/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/pip install -q --upgrade pip
	.venv-torch-$*/bin/pip install -q "torch==$*"
	.venv-torch-$*/bin/pip install -q -e ".[dev,examples]"
	touch $@

test-compat: $(foreach v,$(COMPAT_TORCH),.venv-torch-$(v)/bin/.installed)
	for v in $(COMPAT_TORCH); do .venv-torch-$$v/bin/python -m pytest -q -n auto --maxprocesses=4 $(COMPAT_TESTS) || exit 1; done

# `make bench`: every method on every model (benchmarks/run_all.py; gpt2-12 alone takes ~25 min on 2 CPU cores, the small models ~15).
# BENCH_ARGS passes options, e.g. `make bench BENCH_ARGS="--models mlp,resnet,gpt2-tiny --readme"`.
# The single-purpose scripts stay callable: `make bench-extra` (DP kernel, sequential chain, planning time, plan quality, torch.compile, operator-variant kernels, gradients made in the step, input shapes, a 7B shape planned on meta).
BENCH_ARGS ?=

bench: setup
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

bench-extra: setup
	$(BIN)/python benchmarks/bench_dp.py
	$(BIN)/python benchmarks/bench_sequential.py
	$(BIN)/python benchmarks/bench_plan.py
	$(BIN)/python benchmarks/bench_quality.py
	$(BIN)/python benchmarks/bench_compile.py
	$(BIN)/python benchmarks/bench_lm_head.py
	$(BIN)/python benchmarks/bench_relu_masks.py
	$(BIN)/python benchmarks/bench_in_place.py
	$(BIN)/python benchmarks/bench_kernels.py
	$(BIN)/python benchmarks/bench_step_grads.py
	$(BIN)/python benchmarks/bench_shapes.py
	$(BIN)/python benchmarks/bench_meta.py

clean:
	rm -rf $(VENV) .venv-torch-* .pytest_cache
