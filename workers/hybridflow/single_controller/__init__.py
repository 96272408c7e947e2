"""The single controller's building blocks: batches, transfer protocols, resource pools and worker groups."""
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import Dispatch, DPRank, register

__all__ = ["Batch", "Dispatch", "DPRank", "register"]
