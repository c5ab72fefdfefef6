# `make demo` trains the built-in model on the built-in dataset; `make test` runs the test suite; `make lint` runs ruff and mypy.
# Both create .venv and install what they need. Where $(PYTHON) already has torch (a CUDA build on a GPU image or
# NGC container, often offline), .venv uses that torch and installs only stoker's other dependencies (offline:
# PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR of wheels). Elsewhere it installs the CPU build of torch where no NVIDIA GPU is
# present (instead of the multi-GB CUDA build a plain `pip install torch` pulls). A local torch wheel is installed
# without its dependencies (so pip cannot swap it for another build), then they are installed at once: left to the
# next install, pip printed "ERROR: ... torch requires filelock, which is not installed" during a set-up that works.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CPU_TORCH := torch==2.13.0
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu

# An interpreter that is itself a venv does not hand its packages to --system-site-packages: then the new venv
# reads torch's folder through a .pth file. No pip of its own: an older bundled pip and setuptools would shadow
# the interpreter's.
export SITE_OF_TORCH := import pathlib, torch; print(pathlib.Path(torch.__file__).resolve().parent.parent)
export OWN_SITE := import sysconfig; print(sysconfig.get_paths()["purelib"])
# stoker is built with what is installed (no download of a build environment, so offline works): a setuptools
# that builds wheels without the `wheel` package.
export MODERN_SETUPTOOLS := import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))

.PHONY: demo test lint bench install clean servers jpeg-headers

demo: $(VENV)/.installed  # a run folder holds one run: each demo starts afresh
	rm -rf runs/demo
	$(VENV)/bin/stoker train --out runs/demo

# Three workers on 2 cores (a test's time is mostly processes starting and waiting: with two, a quarter of the
# cores' time went unused, and the suite took 846 s + 85 s on a fresh clone). Each worker starts on a third of the
# tests in file order and an idle one steals from the others (`--dist worksteal`): a module's fixtures mostly run
# once (again only on a worker that steals one of its tests), where `--dist load` ran them on each worker that got
# one of the module's tests and whole files per worker left the last heavy file alone (parallel pass on one 2-core
# machine: 744 s against 969 s with `load`). The tests that
# read the whole machine (/dev/shm, /tmp: marked `serial`) run alone after them. Both passes run; the worse status
# counts (5, no test selected, is not a failure of the second). Each pass ends with its 15 slowest tests, so that
# a log shows where the suite's time goes.
TEST_WORKERS ?= 3

test: $(VENV)/.installed servers
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations 15 -m "not serial" tests; parallel=$$?; \
	$(PY) -m pytest -q --durations 15 -m serial tests; serial=$$?; [ $$serial -eq 5 ] && serial=0; \
	exit $$(( parallel > serial ? parallel : serial ))

# The remote-data tests read shards from a real nginx on loopback (Debian's nginx-light; moto's S3 server comes
# with the test extras). Installed where the machine lets us (root with apt); elsewhere those tests skip, saying why.
servers:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q nginx-light >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1; }; }; } || \
		echo "nginx could not be installed: the HTTP tests will skip"

# stoker/data/pixels/_jpegcrop.c (crop-aware JPEG decoding) builds against libjpeg-turbo's headers: Debian's
# libjpeg62-turbo-dev, installed where the machine lets us. Without them the build skips it and JPEGs are decoded
# whole, to the same pixels (the tests of the crop path then skip, saying what to install).
jpeg-headers:
	@[ -f /usr/include/jpeglib.h ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q libjpeg62-turbo-dev >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libjpeg62-turbo-dev >/dev/null 2>&1; }; }; } || \
		echo "libjpeg-turbo's headers could not be installed: JPEGs will be decoded whole"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check stoker tests tools
	$(VENV)/bin/mypy

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py stoker/data/pixels/_jpegcrop.c | jpeg-headers
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "$(PYTHON) already has torch: .venv uses it"; \
		$(PYTHON) -m venv --system-site-packages --without-pip $(VENV); \
		$(PY) -c "import torch" 2>/dev/null || $(PYTHON) -c "$$SITE_OF_TORCH" > "$$($(PY) -c "$$OWN_SITE")/parent-torch.pth"; \
		$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip -q; \
	else \
		$(PYTHON) -m venv $(VENV); \
		if command -v nvidia-smi >/dev/null 2>&1; then \
			$(PIP) install "torch>=2.6"; \
		elif $(PIP) install -q --no-index --no-deps "$(CPU_TORCH)" 2>/dev/null; then \
			echo "installed the CPU build of torch found locally"; \
			$(PIP) install -q "$(CPU_TORCH)"; \
		else \
			$(PIP) install "$(CPU_TORCH)" --index-url $(CPU_TORCH_INDEX); \
		fi; \
	fi
	$(PY) -c "$$MODERN_SETUPTOOLS" 2>/dev/null || $(PIP) install -q "setuptools>=70.1"
	$(PIP) install -q --no-build-isolation -e ".[test,bench]"
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
