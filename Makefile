# kvctl developer commands. Every target sets up .venv first (quick when it is already there).
PY := .venv/bin/python
KVCTL := .venv/bin/kvctl

.PHONY: setup test test-fast lint run bench completions schema

setup:
	@./scripts/setup

# Real servers, three at a time (pytest-xdist): most of a test's time is spent waiting on a process it
# started; a file stays whole on one worker, sharing its servers, except end-to-end tests, which spread
# (tests/conftest.py: the schedule, longest first).
test: setup lint
	$(PY) -m pytest -n 3 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The in-memory layer, the pure functions, the commands and the property layer on a small budget:
# under 30 s on two cores, no servers started.
test-fast: setup
	$(PY) -m pytest tests/unit tests/fast tests/cli tests/property -q -m "not slow" --hypothesis-profile=quick \
		-n 2 $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

run: setup
	@./scripts/main-job $(ARGS)

bench: setup
	@for bench in benchmarks/[!_]*.py; do echo "== $$bench"; $(PY) $$bench || exit 1; done

completions: setup
	$(KVCTL) completion show bash > completions/kvctl.bash
	$(KVCTL) completion show zsh > completions/_kvctl
	$(KVCTL) completion show fish > completions/kvctl.fish

schema: setup
	$(PY) scripts/gen-lmcache-schema
