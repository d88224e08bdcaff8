# `make run` and `make test` each do all set-up on a fresh machine (Debian packages,
# a virtual environment .venv/ with the CPU build of torch pinned by
# constraints-cpu.txt and dynabatch itself), then run.
#
# The virtual environment is ours, not the system's: Debian's python3 refuses
# `pip install` outside one (PEP 668). It is made once with $(PYTHON); a stamp file
# in it records that pip installed what pyproject.toml and constraints-cpu.txt ask
# for, so later runs skip pip entirely until one of those two files changes.
PYTHON ?= python3
VENV ?= .venv
PY = $(VENV)/bin/python
PIP_INSTALL = $(PY) -m pip install --quiet -c constraints-cpu.txt
SYSTEM_DEPS = PYTHON='$(PYTHON)' bash scripts/system-deps.sh

.PHONY: install install-test install-lint bytecode run test lint bench bench-quick simulate simulate-quick system-deps \
	system-deps-test image image-gpu image-test

install: system-deps $(VENV)/.installed bytecode

install-test: system-deps-test $(VENV)/.installed-test bytecode

install-lint: system-deps $(VENV)/.installed-lint bytecode

# Our sources' bytecode, as pip writes it for every package it installs. An editable install leaves none, and
# where PYTHONDONTWRITEBYTECODE is set no process writes it later, so each one would compile dynabatch from
# source again: 0.1 to 0.3 s of CPU in every launcher, scheduler and test process (bench/RESULTS.md 53).
# compileall skips what is current, so this is quick to repeat; a module edited since is compiled again by the
# next make install, run, test or lint (until then each process compiles it in memory, as before).
BYTECODE = api cli cluster common ps scheduler worker bench tests examples
bytecode: | $(VENV)/pyvenv.cfg
	$(PY) -m compileall -q $(BYTECODE)

# Only what is missing is installed, so these are quick to repeat.
system-deps:
	$(SYSTEM_DEPS)

system-deps-test:
	$(SYSTEM_DEPS) --test

# pyvenv.cfg is a plain file that `venv` writes (bin/python is a link whose time
# is the interpreter's); a failed attempt leaves nothing half made behind.
$(VENV)/pyvenv.cfg: | system-deps
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

$(VENV)/.installed: pyproject.toml constraints-cpu.txt $(VENV)/pyvenv.cfg
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints-cpu.txt $(VENV)/pyvenv.cfg
	$(PIP_INSTALL) -e '.[test,peers]'
	touch $@

$(VENV)/.installed-lint: pyproject.toml constraints-cpu.txt $(VENV)/pyvenv.cfg
	$(PIP_INSTALL) -e '.[test,peers,lint]'
	touch $@

run: install
	$(PY) -m dynabatch.cli.main run $(ARGS)

# pytest caches each test module with its assertions rewritten as bytecode, and writes none where
# PYTHONDONTWRITEBYTECODE is set: then each of its test processes rewrites all of them again, 4.5 s of CPU
# apiece (bench/RESULTS.md 53). The bytecode is ours to write, as above.
test: install-test
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest $(ARGS)

# ruff and mypy, set in pyproject.toml; any finding fails (CI runs it after the tests).
lint: install-lint
	$(PY) scripts/lint.py

# The full benchmark (about 3.5 hours, 2 of them bench/peers.py's tuned comparison) rewrites
# bench/RESULTS.md and bench/plots/; bench-quick takes under 10.
bench: install
	$(PY) -m bench --publish $(ARGS)

bench-quick: install
	$(PY) -m bench --quick $(ARGS)

# The virtual-time simulator's studies: the papers' claims at 16 and 64 simulated workers (bench/simulate_study.py),
# then every method at its tuned step size on the cluster files of bench/profiles/ (bench/tuned_study.py's regime
# study); quick: a check of both, under 2 minutes.
simulate: install
	$(PY) -m bench.simulate --study full $(ARGS)
	$(PY) -m bench.simulate --study regimes $(ARGS)

simulate-quick: install
	$(PY) -m bench.simulate --study quick $(ARGS)
	$(PY) -m bench.simulate --study tuned-quick $(ARGS)

# The container image (Dockerfile), with docker or podman: not part of `make test` (CI runs only the
# suite). Each fails loudly if torch in the image is not the build it asked for. Settings (base
# image by digest, torch's index, a local torch wheel folder, pip's CA) in scripts/image.sh; on a
# machine without a registry for the base image, `scripts/image-base.sh` makes it first
# (docs/operators.md, "The image without a registry"). The names are fully qualified, as podman
# stores them and as the Kubernetes manifests name them: containerd would read a bare
# `dynabatch:0.1.0` as docker.io/library/dynabatch:0.1.0.
IMAGE ?= localhost/dynabatch:0.1.0
IMAGE_GPU ?= localhost/dynabatch:0.1.0-gpu
ifdef CONTAINERS_CONF
export CONTAINERS_CONF := $(abspath $(CONTAINERS_CONF))
endif

image:
	bash scripts/image.sh cpu $(IMAGE)

image-gpu:
	bash scripts/image.sh cuda $(IMAGE_GPU)

# Scheduler, shard, two workers and the evaluator as separate containers of $(IMAGE): the job
# trains, a worker image built with k8s/README.md's recipe joins it, a restarted scheduler resumes.
image-test: install
	$(PY) scripts/image_test.py --image $(IMAGE)
