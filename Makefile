# VENV may point outside the clone (CI reuses one under ~/.cache: the venv is ~6 GB).
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
# Two pytest workers on the two-core dev machine: a test spends much of its time waiting (rendezvous, signals,
# timeouts), and the other worker fills it. tests/conftest.py keeps machine-wide tests on one worker.
TEST_JOBS ?= 2
PYTEST_PAR := -n $(TEST_JOBS)
DEMO_OUT ?= runs/demo
# DeepSpeed JIT-builds its C++ ops once; keep them beside the venv so every run reuses them.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
# The venv may be shared by many clones (CI), so this checkout is put on the path rather than installed into it.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: venv bytecode demo test test-unit test-dist bench clean

# DeepSpeed's CPU accelerator for the CPU runs alone: a GPU run must not inherit it (shardtrain sets it itself
# for --device cpu and says so when a CUDA run finds it set).
test test-unit test-dist demo: export DS_ACCELERATOR ?= cpu

# Installed once per content of the requirements (not their timestamps: every clone would reinstall).
REQ_HASH := $(shell cat requirements.txt requirements-dev.txt requirements-sagemaker.txt | sha256sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)

$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-sagemaker.txt
	touch $@

# The `shardtrain` command, and `python -m shardtrain` from any folder: this checkout installed in editable mode
# (no copy, no network). A shared venv has one such install, so the stamp holds which checkout it points to (and
# pyproject.toml's hash, for its entry points): the last clone to run make gets it; make's own runs use PYTHONPATH.
EDITABLE_ID := $(CURDIR) $(shell sha256sum pyproject.toml | cut -c1-12)
EDITABLE_STAMP := $(VENV)/.editable-checkout

venv: $(STAMP)
	@test "$$(cat $(EDITABLE_STAMP) 2>/dev/null)" = "$(EDITABLE_ID)" || { \
		$(PY) -m pip install -q --no-deps --no-build-isolation -e . && echo "$(EDITABLE_ID)" > $(EDITABLE_STAMP); }

demo: venv
	test -f data/multimodal/validation.jsonl || $(PY) -m shardtrain make-data multimodal data/multimodal
	$(PY) -m shardtrain train --config configs/multimodal_tiny.yaml --strategy fsdp --device cpu \
		--nproc $(NPROC) --data-dir data/multimodal --output-dir $(DEMO_OUT) --resume none --overwrite-output-dir --save-every 20

# Each test launch is a fresh interpreter: where PYTHONDONTWRITEBYTECODE is set (as on the dev machines), every
# one of them would compile the checkout's modules it imports again. Compiled once here, they are only read.
bytecode:
	$(PY) -m compileall -q shardtrain tests examples benchmarks

test: venv bytecode
	$(PY) -m pytest -q $(PYTEST_PAR) tests/unit tests/dist

test-unit: venv bytecode
	$(PY) -m pytest -q $(PYTEST_PAR) tests/unit

test-dist: venv bytecode
	$(PY) -m pytest -q $(PYTEST_PAR) tests/dist

clean:
	rm -rf runs data .pytest_cache
