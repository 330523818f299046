"""capsnet.lightning.CapsuleModule in a real lightning.Trainer: one epoch of a small CapsNet on 300 of the bundled
digits on the CPU, validated, checkpointed by Lightning, reloaded from the checkpoint alone, and saved back as a
capsnet save_pretrained folder; a Lightning checkpoint given to capsnet's loaders is one line."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_MODEL

from capsnet import create_model, load_pretrained
from capsnet.cli import main
from capsnet.data.datasets import load_dataset
from capsnet.errors import CheckpointError, ConfigError
from capsnet.models.recipe import model_input


@pytest.fixture(scope="module")
def lightning():
    """Lightning, imported where a test uses it: at collection, each pytest worker would import it (3 s)."""
    return pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def CapsuleModule(lightning):
    """capsnet.lightning.CapsuleModule (the module imports Lightning)."""
    from capsnet.lightning import CapsuleModule

    return CapsuleModule


def _loaders(n_train: int = 300, n_val: int = 100):
    data = load_dataset("mnist-sample")
    train = torch.utils.data.TensorDataset(data.train.images[:n_train], data.train.labels[:n_train])
    val = torch.utils.data.TensorDataset(data.test.images[:n_val], data.test.labels[:n_val])
    return (
        torch.utils.data.DataLoader(train, batch_size=50, shuffle=True),
        torch.utils.data.DataLoader(val, batch_size=50),
    )


def _trainer(lightning, tmp_path, **kw):
    checkpoint = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_acc", mode="max")
    return lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
        default_root_dir=tmp_path,
        **kw,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, lightning, CapsuleModule):
    tmp = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    model = create_model("capsnet", **SMALL_MODEL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = CapsuleModule(model, augment="shift=2")
    trainer = _trainer(lightning, tmp)
    train, val = _loaders()
    trainer.fit(module, train, val)
    return tmp, trainer, module, before, val


@pytest.mark.slow
def test_one_epoch_trains_every_parameter_and_logs_the_models_own_metrics(trained):
    _, trainer, module, before, _ = trained
    metrics = trainer.callback_metrics
    assert {"train_loss", "train_acc", "train_margin", "train_reconstruction", "val_loss", "val_acc"} <= set(metrics)
    assert all(torch.isfinite(v) for v in metrics.values()) and 0.0 <= float(metrics["val_acc"]) <= 1.0
    changed = [
        k for k, v in module.model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])
    ]
    params = [k for k, _ in module.model.named_parameters()]
    assert set(params) <= set(changed), sorted(set(params) - set(changed))  # every parameter was trained
    assert float(metrics["train_acc"]) > 0.1  # (better than chance on 300 digits after one epoch)


@pytest.mark.slow
def test_the_checkpoint_reloads_alone_and_scores_the_same(trained, tmp_path, lightning, CapsuleModule):
    _, trainer, module, _, val = trained
    path = trainer.checkpoint_callback.best_model_path
    assert path.endswith(".ckpt")
    loaded = CapsuleModule.load_from_checkpoint(path)
    assert type(loaded.model) is type(module.model) and loaded.model.config == module.model.config
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), module.model.state_dict().values())
    )
    assert (loaded.lr, loaded.lr_decay, str(loaded.augment)) == (module.lr, module.lr_decay, "shift=2")
    scores = lightning.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).validate(loaded, val)
    assert scores[0]["val_acc"] == pytest.approx(float(trainer.callback_metrics["val_acc"]), abs=1e-6)
    folder = loaded.model.save_pretrained(tmp_path / "weights")
    again = load_pretrained(folder)
    images = next(iter(val))[0][:8]
    with torch.no_grad():
        assert torch.equal(again(model_input(again, images)).lengths, loaded.eval()(images).lengths)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # (a step called outside a Trainer)
def test_the_module_takes_any_registered_model_and_refuses_anything_else(CapsuleModule):
    baseline = CapsuleModule(create_model("baseline", channels=(8, 8), hidden=(32, 16)))
    images, labels = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8), torch.tensor([0, 1, 2, 3])
    loss = baseline.training_step((images, labels), 0)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in baseline.model.parameters())
    assert baseline.predict_step(images, 0).shape == (4,)
    with pytest.raises(ConfigError, match="not a capsnet model"):
        CapsuleModule(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="lr_decay"):
        CapsuleModule(create_model("capsnet", **SMALL_MODEL), lr_decay=1.5)


@pytest.mark.slow
def test_a_lightning_checkpoint_given_to_capsnets_loaders_is_one_line(trained, tmp_path, capsys):
    from PIL import Image

    tmp, trainer, *_ = trained
    ckpt = trainer.checkpoint_callback.best_model_path
    Image.new("L", (28, 28), 128).save(tmp_path / "x.png")
    with pytest.raises(CheckpointError, match=r"a Lightning checkpoint: .*CapsuleModule.load_from_checkpoint"):
        load_pretrained(ckpt)
    for argv in (
        ["predict", "--checkpoint", ckpt, str(tmp_path / "x.png")],
        ["predict", "--checkpoint", str(tmp / "ckpt"), str(tmp_path / "x.png")],
        ["evaluate", "--checkpoint", ckpt, "--dataset", "mnist-sample"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
