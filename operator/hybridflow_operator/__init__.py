"""The RLHFJob operator (kopf). Torch-free: it imports only `hybridflow.spec` from the worker package."""
