"""Training and evaluation: the train loop, tasks, run folders and checkpoints, torchrun support, metrics.

May import: capsnet.models, capsnet.data, capsnet.nn, capsnet.routing and the foundation modules; never
experiments, viz or cli.
"""

from .evaluate import evaluate, evaluate_checkpoint, predict
from .loop import TrainConfig, TrainResult, train
from .tasks import Batch, ClassificationTask, Task

__all__ = [
    "Batch",
    "ClassificationTask",
    "Task",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "evaluate_checkpoint",
    "predict",
    "train",
]
