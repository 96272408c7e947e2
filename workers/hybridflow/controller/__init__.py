"""The single controller's building blocks: batches, transfer protocols, resource pools and worker groups."""
from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, DPRank, register

__all__ = ["Batch", "Dispatch", "DPRank", "register"]
