"""The RLHFJob operator (kopf). Torch-free: it imports only `hybridflow.api` from the worker package."""
