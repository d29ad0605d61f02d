# make run   install (first time) and train the tiny preset on this machine's CPU
# make test  install (first time) and run the test suite on 8 fake CPU devices
PYTHON ?= python3
VENV ?= .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/python train.py

test: install
	$(VENV)/bin/python -m pytest -q

.PHONY: install run test
