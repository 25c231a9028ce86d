# Two entry points (see README): `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.koala-installed

.PHONY: demo test test-fast setup clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,deepspeed,megatron]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/koala search --profile gpt-chunks-8 -v 2 -m 8 --time-budget 10 --seed 0 --quiet \
		-o out/best.koala --gantt out/best.png

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)  # everything but the multi-process tests (marked slow), on every core (pytest-xdist)
	$(PY) -m pytest -q -m "not slow" -n auto

clean:
	rm -rf $(VENV) .cache
