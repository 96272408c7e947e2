"""The GPU suite (`pytest -m gpu tests/gpu`; see conftest.py and bench/gpu_check.sh). A package, so that its
conftest is `gpu.conftest` and never shadows tests/conftest.py, which test modules import as `conftest`."""
