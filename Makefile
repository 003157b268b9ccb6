# elasticyolo: `make setup` installs everything (idempotent); `make test` and `make demo` run it
# first when the venv is missing or older than its inputs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.elasticyolo-setup
SETUP_INPUTS := pyproject.toml scripts/setup.sh scripts/build_horovod.sh
PYTEST_ARGS ?=

.PHONY: setup test test-slow demo bench clean

$(STAMP): $(SETUP_INPUTS)
	bash scripts/setup.sh

setup:
	bash scripts/setup.sh

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/elasticyolo demo

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
