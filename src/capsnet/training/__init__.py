"""Training and evaluation: the train loop, tasks, run folders and checkpoints, torchrun support, metrics.

May import: capsnet.models, capsnet.data, capsnet.nn, capsnet.routing and the foundation modules; never
experiments, viz or cli.
"""

from .config import FitConfig
from .evaluate import evaluate, evaluate_checkpoint, predict
from .fit import fit
from .loader import LoaderTask
from .loop import TrainConfig, TrainResult, resume, train
from .tasks import Batch, ClassificationTask, Task

__all__ = [
    "Batch",
    "ClassificationTask",
    "FitConfig",
    "LoaderTask",
    "Task",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "evaluate_checkpoint",
    "fit",
    "predict",
    "resume",
    "train",
]
