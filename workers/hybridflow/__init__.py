"""HybridFlow: the code that runs inside an RLHFJob's pods, and `hybridflow run` on one machine."""
__version__ = "0.1.0"
