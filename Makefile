# Entry points (see README): `make course`, `make test` and `make book`. Each sets up .venv itself.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that this project is developed and tested with.
TORCH_SPEC ?= torch==2.13.0

# Spinning OpenMP threads slow torch down badly whenever processes share the cores.
export OMP_WAIT_POLICY ?= PASSIVE

# `make course`: where JupyterLab listens (PORT=9000; a taken port moves to the next free one;
# HOST=0.0.0.0 on a remote machine). It passes --allow-root as root and opens no browser where
# there is no display (see minibatch/labs/launch.py).
# It serves WORKDIR, the learner's copies of the notebooks (made on the first start, never
# overwritten; ignored by Git), so running a chapter leaves the tracked notebooks as they are.
PORT ?= 8888
HOST ?= 127.0.0.1
WORKDIR ?= workspace
COURSE = $(BIN)/python -m minibatch.labs course --host $(HOST) --port $(PORT) --workdir $(WORKDIR)

.PHONY: setup course open-course test book bench mutate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[serve,course,dev]"
	touch $@

# The book's tools (Sphinx, MyST-NB, a theme, MathJax): for `make book` and the tests, not `make course`.
$(VENV)/.installed-book: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -e ".[book]"
	touch $@

# Ray Serve (the optional `ray` extra): `make test` installs it so that tests/cluster/test_ray.py
# tests the Ray backend; `make course` does not need it.
$(VENV)/.installed-ray: $(VENV)/.installed pyproject.toml
	$(BIN)/python -m pip install -q -e ".[ray]"
	touch $@

setup: $(VENV)/.installed

course: setup
	$(COURSE)

# The same command without the setup step (tests/test_make_course.py runs it).
open-course:
	$(COURSE)

# Test files (a notebook is one file) are spread over TEST_WORKERS processes (pytest-xdist);
# --dist loadfile keeps each file, so each notebook's cells and each module's fixtures, in one.
# One OpenMP thread per worker: two workers already fill two cores, and with more threads than
# free cores every parallel region waits for a thread to be scheduled (a tiny-model test took
# 45 s with 2 threads against 17 s with 1 on a loaded machine). Kernel tests set their own.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: setup $(VENV)/.installed-book $(VENV)/.installed-ray
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The chapters and labs as a static HTML site in _build/book/ (stored outputs, nothing executed).
book: setup $(VENV)/.installed-book
	$(BIN)/python tools/build_book.py

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

# Mutation testing of the engine core ([tool.mutmut] in pyproject.toml; not part of CI: hours on 2
# cores, most of it in the mutants no test kills, which run every test that covers them). One OpenMP
# thread keeps torch safe in mutmut's forked workers. MUTANTS="minibatch.scheduler.* minibatch.sampler.*"
# runs only those modules (mutmut's name globs) and keeps earlier results; without it, all from scratch.
# Either way the map of tests to functions is rebuilt (about 2 minutes): mutmut 3.8 reuses a saved one
# and maps only tests new since then, so a function added later would be run against those alone.
MUTANTS ?=
mutate: setup
	$(BIN)/python -m pip install -q -e ".[mutate]"
	$(if $(MUTANTS),rm -f mutants/mutmut-stats.json,rm -rf mutants)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/python tools/mutation_report.py --survivors

clean:
	rm -rf $(VENV) mutants _build
