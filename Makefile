# kvcredit: two commands.
#   make demo   — set up (.venv with torch 2.11.0, release build, model download) and run the demo
#   make test   — set up and run the whole test suite
#   make fuzz   — long fuzz run of every parser (FUZZ_ITERS mutants per target)
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
DEMO_MODEL ?= qwen2.5-coder-0.5b-instruct

.PHONY: venv build test smoke demo models lint fuzz clean-venv

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
	for m in $(sort $(TEST_MODELS) $(DEMO_MODEL)); do $(BIN) models pull $$m || exit 1; done

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

demo: models
	$(BIN) campaign run experiments/demo.toml
	$(BIN) analyze runs/demo
	$(BIN) check runs/demo
	@echo "demo results: runs/demo (report.md, summary.parquet, estimates.parquet, figures)"

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

clean-venv:
	rm -rf $(VENV)
