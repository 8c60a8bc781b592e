# Set-up and entry points. Each target creates the virtualenv and installs the project first (once).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test aot-full bench demo compare-demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The test command of the README and of CI: lint, then the whole suite on CPU. A test that runs past
# TEST_TIMEOUT seconds fails (pytest-timeout) instead of hanging the run; the 15 slowest are listed at the end.
TEST_TIMEOUT ?= 900
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15 --timeout=$(TEST_TIMEOUT)

# The full ahead-of-time compile check of the fused kernel: every autotune candidate of every kernel, dtype and head
# dim, in both modes, plain and windowed/softcapped, compiled for sm_80 and sm_90 and read with ptxas (exit 1 on a
# register spill or on shared memory over its table's budget). `make test` compiles a representative subset of it
# (`uvic.kernels.aot.representative_specs`); any change to kernels/ runs this before it lands. Measured on a 2-core
# machine (load average 2.0; other jobs ran at times, triton 3.8.0, AOT_WORKERS=2): the 2,876 kernels in 56 min
# (6,135 CPU-s) from an empty triton cache, which is what a change to kernels/ leaves (their source is in every
# cache key); 31 min with 908 of them (32%) cached; 8 s with all cached. `make test`'s subset, 128 kernels: 1 min
# 55 s (223 CPU-s) from an empty cache.
AOT_WORKERS ?= 2
aot-full: install
	$(BIN)/python -m uvic.kernels.aot --workers $(AOT_WORKERS)

# Overrides for the training of `demo` and `compare-demo` (dotted key=value, applied to every arm of the comparison),
# e.g. on a shared machine: make demo ARGS="train.cpu_threads=1".
ARGS ?=

# The CPU demo: a tiny U-ViC on the built-in digits (resumable: re-running continues or just re-samples).
demo: install
	$(BIN)/python train.py configs/demo_digits.yaml $(ARGS) --resume
	$(BIN)/python sample.py runs/demo_digits/pipeline --grid runs/demo_digits/grid.png --num-images 64 --grid-scale 4

# The CPU comparison: U-ViT vs U-ViC on the digits in 2x2 patches, 3 seeds each, two runs at a time (resumable:
# re-running continues, then writes the report again). runs/cmp_digits/report.html is the result.
compare-demo: install
	$(BIN)/python compare.py run configs/compare_digits.yaml $(ARGS) --arm uvit model.attention=softmax --arm uvic \
		--seeds 0 1 2 --out runs/cmp_digits --jobs 2

bench: install
	$(BIN)/python benchmarks/bench_attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
