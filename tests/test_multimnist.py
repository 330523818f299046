import pytest
import torch
from helpers import small_config

from capsnet import CapsNet, MarginLoss
from capsnet.data import Split, load_dataset
from capsnet.experiments.multimnist import (
    MultiMNISTTask,
    PairForward,
    PairSampler,
    generate,
    multi_hot,
    pair_loss,
    render_pairs,
    two_longest_correct,
)
from capsnet.nn.losses import reconstruction_loss
from capsnet.training.tasks import Batch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sample():
    data = load_dataset("mnist-sample")
    return Split(data.train.images[:300], data.train.labels[:300]), Split(data.test.images[:50], data.test.labels[:50])


def test_generate_shapes_labels_shifts_and_determinism(sample):
    train, _ = sample
    r = generate(train, 64, seed=3)
    assert r["images"].shape == (64, 1, 36, 36) and r["targets"].shape == (64, 10)
    assert (r["label_a"] != r["label_b"]).all()  # always two different classes
    assert (r["targets"].sum(1) == 2).all()
    assert r["shifts"].abs().max() <= 4 and r["shifts"].min() == -4 and r["shifts"].max() == 4
    assert r["images"].min() >= 0 and r["images"].max() <= 1
    again, other = generate(train, 64, seed=3), generate(train, 64, seed=4)
    assert torch.equal(r["images"], again["images"]) and not torch.equal(r["images"], other["images"])


def test_each_digit_is_its_own_shifted_image_and_both_contribute(sample):
    train, _ = sample
    r = generate(train, 32, seed=0, combine="max")
    a, b, pair = r["image_a"], r["image_b"], r["images"]
    assert torch.equal(pair, torch.maximum(a, b))  # pixel-wise max (the option)
    for i in range(32):
        dy, dx = (4 + r["shifts"][i, :2]).tolist()
        assert a[i].sum() == pytest.approx(a[i, :, dy : dy + 28, dx : dx + 28].sum().item())  # all ink in the window
        assert ((a[i] > b[i]) & (pair[i] == a[i])).any() and ((b[i] > a[i]) & (pair[i] == b[i])).any()


def test_sum_combination_is_clipped_and_the_default():
    """The official code (research/capsules mnist_shift.py) adds the two uint8 digits and clips at 255."""
    x = torch.full((2, 1, 28, 28), 0.7)
    pair, a, _ = render_pairs(x, x, torch.zeros(2, 4, dtype=torch.long))
    assert pair.max() == 1.0 and a[:, :, 4:32, 4:32].min() == pytest.approx(0.7)


def test_partners_are_uniform_over_other_classes():
    labels = torch.tensor([0, 0, 0, 1, 2, 2])
    sampler = PairSampler(labels, 3)
    g = torch.Generator().manual_seed(0)
    first = torch.zeros(3000, dtype=torch.long)
    picks = sampler.partners(first, g)
    assert set(picks.tolist()) == {3, 4, 5}
    counts = torch.bincount(picks, minlength=6)[3:].float()
    assert (counts / counts.sum() - 1 / 3).abs().max() < 0.05


@pytest.mark.slow
def test_task_batches_deterministic_resumable_and_sharded(sample):
    train, test = sample
    task = MultiMNISTTask(train=train, test=test, pairs_per_digit=2)
    kw = dict(batch_size=64, seed=1, device=CPU, generator=None)
    full = list(task.batches(epoch=0, rank=0, world_size=1, **kw))
    assert len(full) == task.num_batches(batch_size=64, world_size=1) == 2 * 5
    assert sum(len(b.images) for b in full) == 2 * 300
    again = list(task.batches(epoch=0, rank=0, world_size=1, **kw))
    assert all(torch.equal(x.images, y.images) for x, y in zip(full, again))
    tail = list(task.batches(epoch=0, rank=0, world_size=1, start=6, **kw))  # resume after 6 batches
    assert all(torch.equal(x.images, y.images) for x, y in zip(full[6:], tail)) and len(tail) == 4
    epoch1 = next(task.batches(epoch=1, rank=0, world_size=1, **kw))
    assert not torch.equal(epoch1.images, full[0].images)
    ranks = [list(task.batches(epoch=0, rank=r, world_size=2, **kw)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == task.num_batches(batch_size=64, world_size=2)
    firsts = torch.cat([b.extras["label_a"] for b in ranks[0][:3] + ranks[1][:3]])
    assert len(firsts) == 300  # round 0 split between the ranks
    for b in full:
        assert (b.extras["label_a"] != b.extras["label_b"]).all()
        assert torch.equal(b.targets, multi_hot(b.extras["label_a"], b.extras["label_b"], 10))


def test_two_longest_capsules_metric():
    lengths = torch.tensor(
        [
            [0.9, 0.8, 0.1, 0.0],  # top two = {0, 1}
            [0.9, 0.1, 0.8, 0.0],  # top two = {0, 2}
            [0.2, 0.3, 0.1, 0.95],  # top two = {3, 1}
        ]
    )
    targets = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1]], dtype=torch.float)
    assert two_longest_correct(lengths, targets).tolist() == [True, False, True]


def test_multi_hot_margin_loss_by_hand():
    lengths = torch.tensor([[0.95, 0.5, 0.05]])
    targets = torch.tensor([[1.0, 1.0, 0.0]])
    expected = 0.0 + (0.9 - 0.5) ** 2 + 0.0  # both present: only digit 1 is below m+; absent digit 2 below m-
    assert MarginLoss(3)(lengths, targets).item() == pytest.approx(expected)
    lengths = torch.tensor([[0.95, 0.95, 0.3]])
    assert MarginLoss(3)(lengths, targets).item() == pytest.approx(0.5 * (0.3 - 0.1) ** 2)


def test_pair_loss_reconstructs_each_digit_from_its_own_capsule(sample):
    train, _ = sample
    r = generate(train, 4, seed=0)
    model = CapsNet(config=small_config(image_size=36)).train()
    out, recon_b = PairForward(model)(r["images"], r["label_a"], r["label_b"])
    assert torch.allclose(out.reconstructions, model.decoder(out.capsules, r["label_a"]))
    assert torch.allclose(recon_b, model.decoder(out.capsules, r["label_b"]))
    loss = pair_loss(model, out, r["targets"], recon_b, r["image_a"], r["image_b"])
    expected = (
        MarginLoss(10, reduction=model.config.margin_reduction)(out.lengths, r["targets"])  # the official half mean
        + reconstruction_loss(out.reconstructions, r["image_a"])
        + reconstruction_loss(recon_b, r["image_b"])
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert model.decoder.net[0].weight.grad is not None


def test_fixed_test_set_and_evaluation(sample):
    train, test = sample
    a = MultiMNISTTask(train=train, test=test, test_pairs_per_digit=2, seed=5)
    b = MultiMNISTTask(train=train, test=test, test_pairs_per_digit=2, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.test_pairs, b.test_pairs)) and len(a.test_pairs[0]) == 100
    from capsnet.training.distributed import DistInfo

    model = CapsNet(config=small_config(image_size=36))
    r = a.evaluate(model, batch_size=40, device=CPU, dist=DistInfo())
    assert r["n"] == 100 and 0 <= r["accuracy"] <= 1 and r["loss"] > 0
    batch = Batch(torch.zeros(1, 1, 36, 36), torch.zeros(1, 10))
    assert batch.extras == {}
