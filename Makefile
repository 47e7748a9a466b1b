# kvcredit: two commands.
#   make demo   — set up (.venv with torch 2.11.0, release build, one small model) and run the
#                 quick demo: a credit campaign, its report and figures (a few minutes on 2 cores)
#   make test   — set up and run the whole test suite
#   make demo-long — the longer demo campaign (Qwen2.5-Coder-0.5B, 8-shot CoT)
#   make fuzz   — long fuzz run of every parser (FUZZ_ITERS mutants per target)
#   make check-core — the core library type-checks without feature `studies`
# Set CARGO_TARGET_DIR to reuse a build folder between clones (CI does).

VENV       ?= .venv
PYTHON     ?= python3
TORCH_VER  := 2.11.0
PY_TEST_PKGS := pandas==3.1.1 polars==2.1.0 pyarrow==26.0.1 nbconvert==7.17.2 nbclient==0.11.0 ipykernel==7.4.0 matplotlib==3.11.2

export LIBTORCH_USE_PYTORCH := 1
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
export KVCREDIT_PYTHON := $(VIRTUAL_ENV)/bin/python

TARGET_DIR := $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),$(CURDIR)/target)
BIN        := $(TARGET_DIR)/release/kvcredit
DEMO_MODEL ?= smollm2-135m-instruct
DEMO_LONG_MODEL ?= qwen2.5-coder-0.5b-instruct

.PHONY: venv build test smoke demo demo-long models lint check-core fuzz clean-venv

venv: $(VENV)/.ready

$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH_VER)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(PY_TEST_PKGS)
	touch $@

build: venv
	cargo build --release

# The models the tests need are listed once, in tests/models.txt (a test keeps it complete).
TEST_MODELS := $(shell grep -v '^\#' tests/models.txt)

models: build
	for m in $(sort $(TEST_MODELS) $(DEMO_MODEL) $(DEMO_LONG_MODEL)); do $(BIN) models pull $$m || exit 1; done

test: models
	cargo test --release --no-fail-fast
	$(MAKE) --no-print-directory smoke

# The whole pipeline on real output: campaign → analyze → check → notebook.
smoke: models
	rm -rf runs/ci-smoke
	$(BIN) campaign run experiments/ci-smoke.toml --out runs/ci-smoke --quiet
	$(BIN) analyze runs/ci-smoke
	$(BIN) check runs/ci-smoke
	cd notebooks && KVCREDIT_RUN_DIR=../runs/ci-smoke $(VIRTUAL_ENV)/bin/jupyter nbconvert --to notebook --execute analysis.ipynb --output-dir ../runs/ci-smoke --output analysis.executed.ipynb
	@echo "smoke pipeline passed: runs/ci-smoke"

# The quick demo: one small model, a three-pass campaign, its report and figures. A rerun of a
# finished campaign changes nothing; delete runs/demo to start over. Its batches are small, so a
# second libtorch thread gains little and costs much when the cores are shared (on a loaded
# 2-core machine: 30 s with one thread, 8 min with two).
DEMO_THREADS ?= 1
demo: build
	$(BIN) models pull $(DEMO_MODEL)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(BIN) campaign run experiments/demo.toml --out runs/demo
	$(BIN) analyze runs/demo
	$(BIN) check runs/demo
	@echo "demo: wrote runs/demo/report.md, runs/demo/disagreement.png and runs/demo/jaccard.png"

demo-long: build
	$(BIN) models pull $(DEMO_LONG_MODEL)
	$(BIN) campaign run experiments/demo-long.toml --out runs/demo-long
	$(BIN) analyze runs/demo-long
	$(BIN) check runs/demo-long
	@echo "demo-long: wrote runs/demo-long/report.md, runs/demo-long/disagreement.png and runs/demo-long/jaccard.png"

# Long fuzz run of every parser (tests/fuzz.rs): FUZZ_ITERS mutants per target, per-target
# counts appended to runs/fuzz/report.jsonl; failing inputs land in the target dir's
# tmp/fuzz-failures/.
FUZZ_ITERS ?= 20000
FUZZ_SEED  ?= 20261201
fuzz: models
	mkdir -p runs/fuzz
	KVCREDIT_FUZZ_ITERS=$(FUZZ_ITERS) KVCREDIT_FUZZ_SEED=$(FUZZ_SEED) KVCREDIT_FUZZ_REPORT=$(CURDIR)/runs/fuzz/report.jsonl \
		cargo test --release --test fuzz -- --nocapture

lint: venv
	cargo fmt --check
	cargo clippy --release --all-targets -- -D warnings

# The core (config, gguf, tokenizer, model, kv_cache, exec, sampling, decode) builds without
# feature `studies`, i.e. without Parquet, Arrow, plotters or indicatif.
check-core: venv
	cargo check --release --lib --no-default-features

clean-venv:
	rm -rf $(VENV)
