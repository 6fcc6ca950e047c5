# The README's two commands are `make demo` and `make test`; `.ci/run` calls `make test`.
# Both create .venv, install the CPU torch wheel *before* the project (so nothing pulls a
# multi-GB CUDA build), then install rlfeed in editable mode.

PYTHON ?= python3
VENV ?= .venv
# GPU users: `make setup TORCH_SPEC=torch` keeps whatever torch>=2.4 build they want.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup system-deps demo test lint bench chaos gencode clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[all,test]"
	touch $@

setup: $(VENV)/.installed

# Prometheus is a Debian package; the integration tests start a real server.
system-deps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else echo "note: prometheus not installed; its integration test will be skipped"; fi; }

demo: setup
	$(BIN)/rlfeed demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup system-deps lint
	$(BIN)/pytest $(PYTEST_ARGS)

# Benchmarks are scripts that print their figures (and assert their hard targets);
# each file's docstring says what it measures and how long it takes.
bench: setup
	@set -e; for script in tests/bench/bench_*.py; do \
	  case $$script in */bench_chaos.py) continue;; esac; \
	  echo "== $$script"; $(BIN)/python $$script; done

# Half an hour of killing the sidecar's parts at random (not in `make bench`): see the
# docstring of tests/bench/bench_chaos.py.
chaos: setup
	$(BIN)/python tests/bench/bench_chaos.py --minutes 30

# The committed gencode (proto/*_pb2*.py) comes from one old grpcio-tools, in a venv of its
# own (it needs protobuf < 5): see GRPCIO_TOOLS_VERSION in proto/generate.py for why.
GRPCIO_TOOLS := $(shell sed -n 's/^GRPCIO_TOOLS_VERSION = "\(.*\)"/\1/p' proto/generate.py)
gencode:
	$(PYTHON) -m venv $(VENV)/gencode
	$(VENV)/gencode/bin/python -m pip install --quiet --only-binary=:all: "grpcio-tools==$(GRPCIO_TOOLS)"
	$(VENV)/gencode/bin/python proto/generate.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
