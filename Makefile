# Two commands on a fresh machine:  `make lab`  and  `make test`.
# Both create .venv/ on first use and reuse it afterwards; `make install` is the shared step.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# CPU wheel on local disk here; GPU users override, e.g. `make install TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.mpnb-installed
# DeepSpeed's JIT ops (~1 min each) are built once per machine into this cache, reused by tests and CI.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/mpnb/torch_extensions
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1
# Written once the ops are built for this venv's torch (the cache is per machine, the venv may change).
DS_OPS = $(TORCH_EXTENSIONS_DIR)/.mpnb-ops-built
PORT ?= 8888

.PHONY: install lab test test-py test-unit test-e2e lint demo browser hosts-tools clean

install: $(STAMP) $(DS_OPS)

$(STAMP): pyproject.toml package.json package-lock.json Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q "hatchling>=1.21" "hatch-jupyter-builder>=0.9" "jupyterlab>=4,<5" editables
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "deepspeed>=0.14"
	PATH="$(abspath $(BIN)):$$PATH" $(PIP) install -q --no-build-isolation -e ".[test]"
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/jupyter labextension develop --overwrite .
	touch $(STAMP)

# Build DeepSpeed's JIT ops once (quietly, ~1 min), so no notebook cell ever compiles them.
$(DS_OPS): $(STAMP)
	@mkdir -p "$(TORCH_EXTENSIONS_DIR)"
	@echo "Building DeepSpeed's CPU ops into $(TORCH_EXTENSIONS_DIR) (once per machine; log: $(TORCH_EXTENSIONS_DIR)/mpnb-build.log)"
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m mpnb.engine.ds_ops > "$(TORCH_EXTENSIONS_DIR)/mpnb-build.log" 2>&1 \
		|| { tail -n 40 "$(TORCH_EXTENSIONS_DIR)/mpnb-build.log"; exit 1; }
	@touch "$@"

# Rebuild the labextension when its sources change (the editable install links the output dir).
mpnb/labextension/package.json: $(STAMP) $(shell find labextension -type f 2>/dev/null) tsconfig.json package-lock.json
	test -d node_modules/@jupyter/builder || npm ci --no-audit --no-fund
	PATH="$(abspath $(BIN)):$$PATH" npm run build
	touch $@

lab: install mpnb/labextension/package.json
	$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(PORT) --notebook-dir=notebooks \
		$$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# Debian's Chromium for the browser tests (never a downloaded browser build).
browser:
	@command -v chromium >/dev/null || { \
		[ "$$(id -u)" = 0 ] && SUDO= || SUDO=sudo; \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# Simulated hosts (tests/cluster/simulated_hosts.py, as root; skipped otherwise): namespaces, an sshd
# on each host, and what ipcluster's MPI and Slurm launchers need there (simulated_slurm.py).
hosts-tools:
	@command -v ip >/dev/null && command -v unshare >/dev/null && command -v ssh >/dev/null \
		&& test -x /usr/sbin/sshd && command -v mpiexec >/dev/null && command -v slurmd >/dev/null \
		&& command -v munged >/dev/null || { [ "$$(id -u)" != 0 ] || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2 util-linux \
		openssh-server openssh-client openmpi-bin slurmctld slurmd slurm-client munge; }; }

lint: install
	$(BIN)/ruff check mpnb tests benchmarks

test-py: install mpnb/labextension/package.json hosts-tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The tests that start no engines, kernels or clusters (under a minute): `make test-py` runs them too.
test-unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# TypeScript unit tests (vitest), then the browser tests (galata, Debian Chromium, own JupyterLab server).
test-e2e: install mpnb/labextension/package.json browser
	npm test
	PATH="$(abspath $(BIN)):$$PATH" npm run test:e2e

test: lint test-py test-e2e

demo: install
	$(BIN)/python -m mpnb.tools.demo build/demo

clean:
	rm -rf $(VENV) node_modules lib mpnb/labextension build ui-tests/chart-benchmark/lib ui-tests/chart-benchmark/build
