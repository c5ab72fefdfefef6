# `make demo` trains the built-in model on the built-in dataset; `make test` runs the test suite.
# Both create .venv and install what they need: the CPU build of torch where no NVIDIA GPU is present (instead of
# the multi-GB CUDA build a plain `pip install torch` pulls), and nothing over a torch that is already there.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CPU_TORCH := torch==2.13.0
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: demo test bench install clean

demo: $(VENV)/.installed  # a run folder holds one run: each demo starts afresh
	rm -rf runs/demo
	$(VENV)/bin/stoker train --out runs/demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: keeping it"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install "torch>=2.6"; \
	elif $(PIP) install -q --no-index --no-deps "$(CPU_TORCH)" 2>/dev/null; then \
		echo "installed the CPU build of torch found locally"; \
	else \
		$(PIP) install "$(CPU_TORCH)" --index-url $(CPU_TORCH_INDEX); \
	fi
	$(PIP) install -q -e ".[test,bench]"
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
