"""The algorithms' registries are hybridflow.registry's (shared with the agents' tools and environments, which sit
beside the algorithms in the layers and so cannot import them)."""
from hybridflow.registry import Registry

__all__ = ["Registry"]
