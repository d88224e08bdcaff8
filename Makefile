# `make run` and `make test` each do all set-up on a fresh machine (Debian packages,
# the CPU build of torch pinned by constraints-cpu.txt, dynabatch itself), then run.
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --quiet -c constraints-cpu.txt

.PHONY: install install-test run test bench bench-quick

install:
	bash scripts/system-deps.sh
	$(PIP_INSTALL) -e .

install-test:
	bash scripts/system-deps.sh --test
	$(PIP_INSTALL) -e '.[test]'

run: install
	$(PYTHON) -m dynabatch.cli.main run $(ARGS)

test: install-test
	$(PYTHON) -m pytest

# The full benchmark (about 70 minutes) rewrites bench/RESULTS.md and bench/plots/; bench-quick takes under 10.
bench: install
	$(PYTHON) -m bench --publish $(ARGS)

bench-quick: install
	$(PYTHON) -m bench --quick $(ARGS)
