"""Training and evaluation: the train loop, tasks, run folders and checkpoints, torchrun support, metrics.

May import: capsnet.models, capsnet.data, capsnet.nn, capsnet.routing and the foundation modules; never
experiments, viz or cli.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .config import FitConfig
    from .evaluate import evaluate, evaluate_checkpoint, predict
    from .fit import fit
    from .loader import LoaderTask
    from .loop import TrainConfig, TrainResult, resume, train
    from .tasks import Batch, ClassificationTask, Task

# Each name imports its module at its first read (torch-free modules of the package load without torch).
__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        "FitConfig": "config",
        "evaluate": "evaluate",
        "evaluate_checkpoint": "evaluate",
        "predict": "evaluate",
        "fit": "fit",
        "LoaderTask": "loader",
        "TrainConfig": "loop",
        "TrainResult": "loop",
        "resume": "loop",
        "train": "loop",
        "Batch": "tasks",
        "ClassificationTask": "tasks",
        "Task": "tasks",
    },
)

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
