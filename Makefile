# Two entry points (see README): `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.koala-installed

.PHONY: demo test test-fast setup clean gpu-wheels

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

# test: everything, in two runs: the fast tests on every core (test-fast), then the multi-process
# ones (marked slow), one at a time, as each starts its own ranks and some time their deadlines.
test: test-fast
	$(PY) -m pytest -q -m slow

# test-fast keeps Python's bytecode caches (__pycache__, ignored by git) even where the environment
# turns them off (PYTHONDONTWRITEBYTECODE, set on this project's machines): each xdist worker
# otherwise compiles koala_ds and rewrites every test module's asserts again on every run.
test-fast: $(STAMP)  # everything but the multi-process tests (marked slow), on every core (pytest-xdist)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not slow" -n auto

# What the GPU machine (no network; Python 3.12, torch with CUDA already there) needs to run
# benchmarks/gpu_check.py: deepspeed (source-only on PyPI: its wheel is built here, pure Python,
# no ops prebuilt), megatron-core and the small pure-Python deps it lacks. Into $(GPU_WHEELS)
# (ignored by git; 7.4 MiB, well under the 64 MiB that travels); gpu_check.py installs them
# with pip --no-index when the folder exists.
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_PURE = hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
GPU_PLATFORMS = --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64
gpu-wheels: | $(STAMP)  # order-only: an existing venv is used as it is
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) deepspeed==0.19.8
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) megatron-core==0.16.1 pydantic-core==2.50.5 $(GPU_PURE)
	du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS)

clean:
	rm -rf $(VENV) .cache
