# kvcredit: two commands.
#   make demo   — set up (.venv with torch 2.11.0, release build, model download) and run the demo
#   make test   — set up and run the whole test suite
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

.PHONY: venv build test demo models lint clean-venv

venv: $(VENV)/.ready

$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH_VER)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(PY_TEST_PKGS)
	touch $@

build: venv
	cargo build --release

models: build
	$(BIN) models pull smollm2-135m-instruct
	$(BIN) models pull $(DEMO_MODEL)

test: models
	cargo test --release --no-fail-fast

demo: models
	$(BIN) generate --model $(DEMO_MODEL) --chat "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?" --max-new-tokens 96

lint: venv
	cargo fmt --check
	cargo clippy --release --all-targets -- -D warnings

clean-venv:
	rm -rf $(VENV)
