# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.omnistage-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
# the suite mostly waits on servers it starts (a third of two cores busy): two pytest-xdist
# workers, each test file whole on one worker (its module-scoped server shared by its tests)
TEST_WORKERS ?= 2

# Never let the repository root onto sys.path: its folders are subpackages of `omnistage`,
# and a top-level `kernels` package would break `import transformers`.
export PYTHONSAFEPATH := 1

.PHONY: install run test lint clean system-deps

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	@# the fused CPU kernels compile once per machine (~30 s); engines fall back to eager ops without them
	-$(PY) -m omnistage.kernels.cpu_fused
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/omnistage serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Debian packages some tests drive (Chromium, PostgreSQL, espeak-ng); installed when root
system-deps:
	@./scripts/system-deps.sh

test: $(STAMP) system-deps lint
	$(VENV)/bin/pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
