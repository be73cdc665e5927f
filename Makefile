# Two entry points: `make run` (set up, then serve the embedded default until Ctrl-C) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRA ?= cpu

.PHONY: setup run test test-fast bench-target bench-engine acceptance-matrix clean prometheus vllm-suffix

setup: $(VENV)/.installed prometheus

# Debian's prometheus and promtool: the tests scrape the served graph with a real Prometheus and unit-test the alert
# rules (ops/prometheus/); installed once, where they are missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# pip pulls CUDA builds of torchvision/torchaudio/torchcodec alongside vllm; they break transformers' imports
# on CPU machines and no text model needs them, so they are removed right after the install. scikit-learn comes
# with lm-eval (a test dependency) and is removed too: none of the tests' lm-eval tasks use it, and where it is
# installed transformers imports it (with scipy.stats) in every process that loads a model, 2-3 s of each Ray
# replica's start on the 2-core CPU; a serving install (without the test extra) never has it.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRA),test]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PIP) uninstall -y -q scikit-learn
	touch $@

# The whole serving graph on this machine with the shipped models: OpenAI API on 127.0.0.1:8000, the Ray
# dashboard on 127.0.0.1:8265; prints both once a completion has gone through, and Ctrl-C stops everything.
run: setup
	$(VENV)/bin/cosine serve examples/local.yaml

test: setup
	$(VENV)/bin/pytest -q -n 2 --durations=10 tests  # two workers (tests/conftest.py); ends with the slowest ten tests

# The edit-test loop: everything but the tests marked slow (vLLM engines, Ray clusters, subprocesses).
test-fast: setup
	$(VENV)/bin/pytest -q -n 2 -m "not slow" tests

bench-target: setup
	$(VENV)/bin/cosine models bench-target

bench-engine: setup
	$(VENV)/bin/cosine bench engine

acceptance-matrix: setup
	$(VENV)/bin/cosine models acceptance-matrix

# vLLM's `suffix` method (a row of `cosine bench anchors`) imports arctic-inference, published as an sdist whose setup
# imports torch: built in a throwaway venv that sees this venv's torch, installed apart from the venv in
# $(SUFFIX_DIR), which only that row's worker puts on its path (its vllm.general_plugins hook, patches for another
# vLLM version, is never loaded: benchmarks/workers.py). Needs a C++20 compiler.
SUFFIX_DIR ?= .vllm-suffix
SUFFIX_BUILD := $(SUFFIX_DIR)-build
vllm-suffix:
	rm -rf $(SUFFIX_DIR) $(SUFFIX_BUILD)
	$(PY) -m venv $(SUFFIX_BUILD)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(SUFFIX_BUILD)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz-cosine-venv.pth"
	$(SUFFIX_BUILD)/bin/pip install -q setuptools wheel ninja "cmake>=3.18" nanobind==2.9.2 protobuf==5.29.5 grpcio-tools
	PATH="$(abspath $(SUFFIX_BUILD))/bin:$$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(SUFFIX_BUILD))/bin/python" \
		$(SUFFIX_BUILD)/bin/pip wheel -q --no-deps --no-build-isolation arctic-inference==0.1.1 -w $(SUFFIX_BUILD)/wheels
	$(SUFFIX_BUILD)/bin/pip install -q --no-deps --target $(SUFFIX_DIR) $(SUFFIX_BUILD)/wheels/arctic_inference-*.whl
	rm -rf $(SUFFIX_BUILD)

clean:
	rm -rf $(VENV) .pytest_cache
