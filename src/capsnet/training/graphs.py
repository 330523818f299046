"""The training step captured as one CUDA graph and replayed (`TrainConfig.cuda_graphs`, `capsnet train --cuda-graphs`).

A CapsNet step at batch 128 launches several hundred small kernels; on a fast GPU the host's time to launch them,
not the arithmetic, sets the pace. Replaying the whole step as one CUDA graph launches it with one call. Captured,
for the classification task with its uint8 training set resident on the GPU:

- the batch: a gather from the resident set by a static index buffer (the epoch's shuffled indices are copied into
  it before each replay), then the task's own `make_batch`: the model's input recipe and the augmentation, whose
  random numbers come from the run's augmentation generator, registered with the graph (each replay draws new
  numbers, as eager steps do);
- forward, loss and backward (the gradients live in the graph's memory pool);
- the optimizer step: Adam built with `capturable=True` (`capsnet.training.build.make_adam`), its learning rate
  a device tensor that the schedule updates in place.

Every replay has the same batch shape. An epoch's last, smaller batch runs eagerly (as the task's own batches would
run it), and so do the WARMUP steps before the capture, through the same static buffers, on a side stream: cuBLAS,
cuDNN, the autograd engine and Adam's state are set up by then, as a capture requires. Without a CUDA device, with
another task, with a training set kept on the host, with torch.compile or under torchrun, or if the capture fails,
the run trains eagerly after one line saying why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch

from ..data.batching import epoch_indices
from ..logs import LOGGER
from .classification import ClassificationTask
from .tasks import Batch

WARMUP = 3  # eager steps before the capture (torch.cuda.graphs: "a few")
StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # train_step(run, batch) -> (loss, n_correct)


def unsupported(run) -> str | None:
    """Why the run's step cannot be captured, or None if it can be tried."""
    if run.device.type != "cuda":
        return f"needs a CUDA device, not {run.device.type}"
    if run.config.compile:
        return "not combined with --compile (torch.compile has its own graphs: mode='reduce-overhead')"
    if run.dist.enabled:
        return "not under torchrun"
    task = run.task
    if not isinstance(task, ClassificationTask) or type(task).batches is not ClassificationTask.batches:
        return f"the {task.name} task makes its batches in its own way"
    if task.on_device("train", run.device) is None:
        return "the training set does not fit on the GPU (it is kept on the host)"
    return None


def epoch_steps(run, epoch: int, start: int, step: StepFn) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]] | None:
    """The (loss, n_correct, batch size) of each step of `epoch` from batch `start`, by graph replays; None when
    the run trains eagerly (one line on rank 0 the first time: `unsupported`). The run keeps its
    `StepGraph` (`run.step_graph`) from epoch to epoch."""
    if run.step_graph is None:
        why = unsupported(run)
        run.step_graph = StepGraph(run, step) if why is None else why
        if why is not None:
            _say(run, why)
    if isinstance(run.step_graph, str):
        return None
    return run.step_graph.epoch(epoch, start)


def _say(run, why: str) -> None:
    if run.dist.is_main:
        LOGGER.warning(f"capsnet: --cuda-graphs: {why}; training eagerly")


class StepGraph:
    """The training step on static buffers: `WARMUP` eager steps, then a capture, then replays. With
    `capture=False` (or after a failed capture) it keeps running the same static step eagerly."""

    def __init__(self, run, step: StepFn, *, capture: bool = True):
        assert run.config.batch_size is not None  # resolved by build()
        self.run, self.step, self.capture = run, step, capture
        self.split = run.task.on_device("train", run.device)
        self.batch_size = run.config.batch_size
        self.index = torch.zeros(self.batch_size, dtype=torch.long, device=self.split.images.device)  # static
        self.warm = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's (loss, n_correct)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Steps `start`, ... of `epoch`, over the batches the task's own `batches()` would give."""
        run, size = self.run, self.batch_size
        order = epoch_indices(
            len(self.split),
            shuffle=True,
            seed=run.config.seed,
            epoch=epoch,
            rank=run.dist.rank,
            world_size=run.dist.world_size,
            repeats=run.task.repeats,
        ).to(self.split.images.device)
        for lo in range(start * size, len(order), size):
            take = order[lo : lo + size]
            if len(take) < size:  # the epoch's last, smaller batch: eagerly, as the task makes it
                loss, n_correct = self._eager(lambda take=take: self.step(run, self._batch(take)))
                yield loss, n_correct, len(take)
                continue
            self.index.copy_(take)
            loss, n_correct = self._next()
            yield loss, n_correct, size

    def _batch(self, take: torch.Tensor) -> Batch:
        """The examples `take` of the resident training split, made into a batch by the task's own
        `make_batch` (the model's recipe, then the augmentation), as its eager batches are."""
        images = self.split.images[take].to(self.run.device, non_blocking=True)
        labels = self.split.labels[take].to(self.run.device, non_blocking=True)
        return self.run.task.make_batch(images, labels, self.run.augment_rng)

    def static_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on the batch that the static index buffer names (what the graph captures)."""
        return self.step(self.run, self._batch(self.index))

    def _next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            return self.outputs[0].clone(), self.outputs[1].clone()  # (the next replay overwrites them)
        if not self.capture or self.warm < WARMUP:
            self.warm += 1
            return self._eager(self.static_step, side_stream=self.capture)
        return self._capture()

    def _eager(self, fn, *, side_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`fn()` eagerly (on a side stream before the capture, as torch.cuda.graphs asks of warm-up steps)."""
        with warnings.catch_warnings():  # capturable Adam's note that a step runs uncaptured
            warnings.filterwarnings("ignore", message=".*capturable=True.*without CUDA graph capture")
            if not (side_stream and self.run.device.type == "cuda"):
                return fn()
            main, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                loss, n_correct = fn()
            main.wait_stream(side)
            for t in (loss, n_correct):
                t.record_stream(main)  # used on the main stream next: not to be reused before it is done
            return loss, n_correct

    def _capture(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Capture the static step and replay it once (the capture itself runs nothing); on failure, one line and
        the eager static step from then on."""
        run = self.run
        tensor_learning_rates(run.optimizer, run.device)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(run.augment_rng)  # replays draw from the augmentation stream
        run.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in its pool
        try:
            with torch.cuda.graph(graph):
                outputs = self.static_step()
        except Exception as e:
            self.capture = False
            _say(run, f"the step could not be captured ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            run.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(run.device)
            return self._eager(self.static_step)
        self.graph, self.outputs = graph, outputs
        return self._next()


def tensor_learning_rates(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make each parameter group's learning rate a 0-d device tensor (in place of a float, which a capture would
    freeze): the schedule then updates it in place (LRScheduler fills tensor learning rates) and replays see it."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
