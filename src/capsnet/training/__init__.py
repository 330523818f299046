"""Training: the ways in (fit, train, resume), the loop, tasks, the evaluator, run folders, torchrun support.

May import: capsnet.models, capsnet.data, capsnet.nn, capsnet.routing and the foundation modules; never inference,
experiments, viz or cli.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .api import fit, resume, train
    from .classification import ClassificationTask
    from .config import FitConfig, TrainConfig, TrainResult
    from .evaluator import evaluate
    from .loader import LoaderTask
    from .tasks import Batch, Task

# Each name imports its module at its first read (torch-free modules of the package load without torch).
__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        "FitConfig": "config",
        "evaluate": "evaluator",
        "fit": "api",
        "LoaderTask": "loader",
        "TrainConfig": "config",
        "TrainResult": "config",
        "resume": "api",
        "train": "api",
        "Batch": "tasks",
        "ClassificationTask": "classification",
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
    "fit",
    "resume",
    "train",
]
