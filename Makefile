# simengine: `make sim SCENARIO=name` and `make test` are all a new user needs.
SCENARIO ?= agent_multiturn
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: sim test test-all fuzz bench accuracy lint clean venv conformance-record

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,kernels]'
	touch $(STAMP)

venv: $(STAMP)

sim: $(STAMP)
	$(BIN)/simengine run $(SCENARIO)

# the tests spread over every core (pytest-xdist; `-n 0` in PYTEST_ARGS runs them in one process)
PYTEST_ARGS ?= -n auto
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)   # also the long queueing-theory runs and every bad-input case in its own process
	SIMENGINE_SLOW=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

fuzz: $(STAMP)
	$(BIN)/python -m pytest tests/test_fuzz_invariants.py -q -p tests.fuzz_report --hypothesis-profile=fuzz

bench: $(STAMP)
	$(BIN)/python bench/run.py

# the simulator's error on published measurements, per row, into the table run reports read (validate/accuracy.py):
# the shared calibration files and the judged-only files of docs/judge/ (about 10 minutes on 2 cores)
SHARED ?= ../shared
ACCURACY_FILES := $(SHARED)/data/validation/public_measurements.csv $(SHARED)/data/validation/serving_measurements.csv \
	$(wildcard docs/judge/*.csv)
accuracy: $(STAMP)
	for f in $(ACCURACY_FILES); do \
	  $(BIN)/simengine validate $$f --quiet --out results/validation/$$(basename $$f .csv) \
	    --accuracy simengine/validate/accuracy.csv || exit 1; done

# vLLM's real scheduler on random traces -> tests/conformance/vllm-<version>/*.json.gz (docs/conformance.md). Its own
# environment (vLLM with its CUDA torch, ~9 GB); not part of `make test`, which replays the recorded fixtures.
CONFORMANCE_VENV := .venv-conformance
VLLM_VERSION ?= 0.33.0
$(CONFORMANCE_VENV)/.installed-$(VLLM_VERSION):
	$(PYTHON) -m venv $(CONFORMANCE_VENV)
	$(CONFORMANCE_VENV)/bin/pip install --quiet vllm==$(VLLM_VERSION)
	touch $@

conformance-record: $(CONFORMANCE_VENV)/.installed-$(VLLM_VERSION)
	$(CONFORMANCE_VENV)/bin/python tests/conformance/record_vllm.py --traces 1000

lint: $(STAMP)
	$(BIN)/ruff check simengine tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) results/* plots/*
