# Quick start: `make bench` and `make test`; each does its own set-up.
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.layerwise-setup
EXT    := layerwise/.built
SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h) setup.py pyproject.toml

.PHONY: setup build test lint bench check-cuda clean

# Each step says what it does and how long it usually takes; pip shows its own
# progress where a step takes minutes (the torch install, the C++ build).
setup: $(STAMP)
$(STAMP): scripts/setup_env.sh
	@bash scripts/setup_env.sh
	@touch $@

# --no-build-isolation: otherwise pip fetches a second torch into a build env.
build: $(EXT)
$(EXT): $(STAMP) $(SOURCES)
	@echo "build: compiling the native extension with pip (~45 s on 2 idle cores, minutes on busy ones)"
	@t0=$$(date +%s) && $(VPY) -m pip install --progress-bar on --no-build-isolation --no-deps -e . && \
	  touch $@ && echo "build: done in $$(( $$(date +%s) - t0 )) s"

test: build
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# ruff: pyflakes, pycodestyle, import order, and SLF001 (no module reads another object's
# private attributes) on the package; the tests' and scripts' allowance is in pyproject.toml.
# mypy: the planning modules and the options (pyproject.toml's [tool.mypy] files; ~15 s).
lint: $(STAMP)
	$(VPY) -m ruff check layerwise scripts tests
	$(VPY) -m mypy

# On a machine without a GPU the benchmark runs its CPU suites in --quick mode
# (~3 min on 2 cores); each suite prints its table as it finishes.
bench: build
	$(VPY) -m layerwise.bench $(BENCH_ARGS) $$($(VPY) -c "import torch; print('' if torch.cuda.is_available() else '--quick')")

# Builds the CUDA variant against the installed toolkit (no GPU needed), imports
# it and checks that CUDA requests fail with a clear "no CUDA device" error.
check-cuda: $(STAMP)
	LAYERWISE_BUILD=cuda $(VPY) setup.py -q build_ext --build-lib build/cuda-check/lib --build-temp build/cuda-check/tmp
	$(VPY) scripts/check_cuda_build.py build/cuda-check/lib

clean:
	rm -rf build layerwise/_C*.so $(EXT) *.egg-info
