from pathlib import Path

import numpy as np
import pytest
import torch

from capsnet.data import Split, load_dataset
from capsnet.errors import DatasetError
from capsnet.experiments.affnist import (
    ExpandedMNISTTask,
    affine_test_set,
    expanded_test_set,
    load_affnist,
    random_placement,
)


@pytest.fixture(scope="module")
def test_split():
    data = load_dataset("mnist-sample")
    return Split(data.test.images[:64], data.test.labels[:64])


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_random_placement_keeps_every_digit_whole(test_split):
    x = test_split.images.float()
    g = torch.Generator().manual_seed(0)
    out, corner = random_placement(x, g)
    assert out.shape == (64, 1, 40, 40)
    assert corner.min() >= 0 and corner.max() <= 12 and len(torch.unique(corner[:, 0])) > 5
    for i in range(64):
        top, left = corner[i].tolist()
        assert torch.equal(out[i, :, top : top + 28, left : left + 28], x[i])
        assert out[i].sum() == x[i].sum()


def test_expanded_and_affine_test_sets_are_deterministic(test_split):
    e1, e2 = expanded_test_set(test_split, seed=1), expanded_test_set(test_split, seed=1)
    assert e1.images.dtype == torch.uint8 and e1.images.shape == (64, 1, 40, 40)
    assert torch.equal(e1.images, e2.images) and torch.equal(e1.labels, test_split.labels)
    a1, a2, a3 = (affine_test_set(test_split, seed=s) for s in (1, 1, 2))
    assert a1.images.shape == (64, 1, 40, 40) and a1.images.dtype == torch.uint8
    assert torch.equal(a1.images, a2.images) and not torch.equal(a1.images, a3.images)
    assert (a1.images.flatten(1).amax(1) > 0).all()  # no digit lost


def test_affine_without_rotation_shear_scale_is_a_translation(test_split):
    plain = affine_test_set(test_split, seed=0, rotation=0.0, shear=0.0, scale=(1.0, 1.0))
    # ink is kept whole: the same pixel values, moved inside the canvas
    for i in range(64):
        a = torch.sort(plain.images[i].flatten()).values[-300:]
        b = torch.sort(test_split.images[i].flatten()).values[-300:]
        assert torch.equal(a, b)


def test_affine_transform_keeps_ink_inside_and_varies_pose(test_split):
    a = affine_test_set(test_split, seed=0)
    centred = affine_test_set(test_split, seed=0, rotation=0.0, shear=0.0, scale=(1.0, 1.0))
    # the ink mass changes with scale (bilinear resampling) but stays of the same order
    ratio = a.images.float().sum((1, 2, 3)) / test_split.images.float().sum((1, 2, 3))
    assert (ratio > 0.5).all() and (ratio < 1.7).all()
    assert not torch.equal(a.images, centred.images)


def test_load_affnist_idx_folder_and_errors(tmp_path, test_split):
    folder = tmp_path / "aff"
    folder.mkdir()
    images = affine_test_set(test_split, seed=0).images[:, 0].numpy()
    _write_idx(folder / "t10k-images-idx3-ubyte", images)
    _write_idx(folder / "t10k-labels-idx1-ubyte", test_split.labels.numpy())
    split = load_affnist(folder)
    assert split.images.shape == (64, 1, 40, 40) and torch.equal(split.labels, test_split.labels)
    with pytest.raises(DatasetError, match="no such"):
        load_affnist(tmp_path / "missing")
    small = tmp_path / "small"
    small.mkdir()
    _write_idx(small / "t10k-images-idx3-ubyte", test_split.images[:, 0].numpy())
    _write_idx(small / "t10k-labels-idx1-ubyte", test_split.labels.numpy())
    with pytest.raises(DatasetError, match="40x40"):
        load_affnist(small)


def test_mat_files_need_scipy_or_load_with_it(tmp_path):
    (tmp_path / "test.mat").write_bytes(b"MATLAB 5.0 MAT-file, not really")
    try:
        import scipy.io  # noqa: F401
    except ImportError:
        with pytest.raises(DatasetError, match="scipy"):
            load_affnist(tmp_path)
    else:
        with pytest.raises(DatasetError, match="not an affNIST"):
            load_affnist(tmp_path)


def test_expanded_task_batches(test_split):
    task = ExpandedMNISTTask(train=test_split, test=test_split)
    assert task.model_fields().items() >= {"in_channels": 1, "image_size": 40, "n_classes": 10}.items()
    g = torch.Generator().manual_seed(0)
    batches = list(task.batches(epoch=0, batch_size=32, seed=0, rank=0, world_size=1, device="cpu", generator=g))
    assert len(batches) == task.num_batches(batch_size=32, world_size=1) == 2
    assert batches[0].images.shape == (32, 1, 40, 40) and batches[0].targets.shape == (32,)
