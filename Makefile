# loopserve: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODELS := repository/classifier/1/model.onnx repository/mlp/1/model.onnx repository/tiny/1/model.onnx \
	repository/detector/1/model.onnx

.PHONY: serve test check lint types bench models install clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

$(MODELS) &: $(BIN)/.installed models/build.py models/onnxbuild.py
	$(BIN)/python -m models.build --repository repository

models: $(MODELS)

serve: install models
	$(BIN)/uvicorn server:app --host $(HOST) --port $(PORT) --no-access-log

test: install models
	rm -f .coverage .coverage.*
	$(BIN)/python -m coverage run -m pytest
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --fail-under=90 --skip-covered

lint: install
	$(BIN)/ruff format --check pipeline models tests bench server.py
	$(BIN)/ruff check pipeline models tests bench server.py

types: install
	$(BIN)/mypy

check: lint types test

bench: install models
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(BIN)/python -m bench

clean:
	rm -rf build .coverage repository/*/[0-9]*/
