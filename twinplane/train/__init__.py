from twinplane.train.batch import Batch
from twinplane.train.trainer import Reference, Trainer

__all__ = ["Batch", "Reference", "Trainer"]
