# make run   install (first time) and train the tiny preset on this machine's CPU
# make test  install (first time) and run the test suite on 8 fake CPU devices, JOBS processes
#            (with jemalloc where the machine has it: JEMALLOC below)
# make gpu-check              the GPU check (bench/gpu.py) with the venv's python
# make gpu-check PY=python    the same with an installed python (GPU machine: pip install -e . --no-deps)
# make gpu-tune [PY=python]   tune the Pallas attention kernel's tiles at H = 128 and 64 (bench/tune_attention.py)
# PYTHON picks the interpreter, VENV the folder, PIP_PINS extra requirements (e.g. the jax floor):
#   make test PYTHON=python3.12 VENV=.venv-newest           newest jax (needs Python >= 3.12)
#   make test PIP_PINS="jax==0.10.2 jaxlib==0.10.2"         the oldest jax meshtrain supports
# EXTRAS the extras installed (default test; EXTRAS=test,hf adds transformers + torch for the
# reference test of tools/convert.py, skipped without them)
PYTHON ?= python3
VENV ?= .venv
PIP_PINS ?=
EXTRAS ?= test
PY ?=
# pytest-xdist workers; each test file runs whole in one of them (--dist loadfile), so a file's
# session fixtures are built once. 2 = the CI machine's cores.
JOBS ?= 2
# jemalloc in place of glibc's malloc where the machine has it (Debian and Ubuntu: libjemalloc2;
# .ci/run installs it). The tests' time is mostly XLA compiling, whose LLVM and MLIR passes
# allocate and free small objects by the million: glibc's malloc took about 12% of the samples
# of a compile-bound test, and three test files ran in 0.83-0.95x the time with jemalloc (README).
# The tests' numbers do not depend on it. JEMALLOC= runs them with glibc's malloc.
JEMALLOC ?= $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2))

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[$(EXTRAS)]" $(PIP_PINS)
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/python train.py

test: install
	$(VENV)/bin/python -c "import jax, sys; print(f'python {sys.version.split()[0]}, jax {jax.__version__}, malloc $(or $(JEMALLOC),glibc)')"
	$(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC) )$(VENV)/bin/python -m pytest -q -n $(JOBS) --dist loadfile --durations=15

# PY given: no venv, that interpreter as it is; otherwise the venv (installed first).
gpu-check: $(if $(PY),,install)
	$(if $(PY),$(PY),$(VENV)/bin/python) -m bench.gpu

gpu-tune: $(if $(PY),,install)
	$(if $(PY),$(PY),$(VENV)/bin/python) -m bench.tune_attention --head-dim 128
	$(if $(PY),$(PY),$(VENV)/bin/python) -m bench.tune_attention --head-dim 64

.PHONY: install run test gpu-check gpu-tune
