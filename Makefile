# Two commands for a fresh machine (README): `make demo` and `make test`.
# Each creates the virtual environment and installs the package when needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit test-integration ui bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)  ## FedTGP on the embedded digits, 20 clients, async, local Ray
	$(BIN)/rayfed-proto run

test: $(STAMP)  ## the whole suite: unit (no Ray) then integration (real actors, MLflow)
	$(BIN)/python -m pytest -q --durations=30 tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

ui: $(STAMP)  ## browse runs written from this folder: prints the latest experiment's runs link ("Model training" view)
	$(BIN)/rayfed-proto ui --tracking-uri sqlite:///$(CURDIR)/mlflow.db $(if $(EXPERIMENT),--experiment $(EXPERIMENT))

bench: $(STAMP)
	$(BIN)/python bench/utilisation.py

lint: $(STAMP)
	$(BIN)/ruff check rayfed_proto tests bench

clean:
	rm -rf $(VENV) runs mlflow.db mlflow.db.lock .pytest_cache
