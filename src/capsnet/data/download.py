"""Known downloadable data sets, their checksums and mirrors, and how a set is downloaded into the cache.

Each file comes through `capsnet.fetch.fetch_url` (urllib only): checked against its Content-Length and MD5
before it lands in the cache, written atomically (a failed or killed download never leaves a partial file),
retried TRIES_PER_MIRROR times with backoff on any fault another try may get past (a dropped connection, a cut
body, a timeout, wrong bytes), then fetched from the next mirror. A set is downloaded by one process at a time
(a lock file beside its cache folder): under torchrun the first rank on a machine fetches and unpacks it, and the
others wait, then find it there.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import ConfigError, DatasetError, DownloadError
from ..fetch import cache_root as cache_root  # (capsnet's cache folder: data sets and pretrained weights)
from ..fetch import fetch_url, file_digest, url_problem
from ..fileio import atomic_open

# The four files of an MNIST-format data set, in the order they are fetched and listed.
FILE_NAMES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

# Known downloadable sets: gz file name -> MD5, and base URLs tried in order.
# Sources of the checksums and URLs:
# - MNIST: torchvision's `MNIST.resources`/`MNIST.mirrors` (github.com/pytorch/vision,
#   torchvision/datasets/mnist.py); the Google CVDF mirror is TensorFlow's tutorial source.
# - Fashion-MNIST: github.com/zalandoresearch/fashion-mnist README (file table with MD5s) and
#   torchvision's `FashionMNIST.resources`.
# - KMNIST: github.com/rois-codh/kmnist and torchvision's `KMNIST.resources`.
DATASETS: dict[str, dict[str, Any]] = {
    "mnist": {
        "files": {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        "mirrors": [
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
            "http://yann.lecun.com/exdb/mnist/",
        ],
        "counts": (60000, 10000),
    },
    "fashion-mnist": {
        "files": {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        "mirrors": [
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ],
        "counts": (60000, 10000),
        # Not digits: left-right flips keep the class, and `predict` does not box images as MNIST's. The class names
        # of the Fashion-MNIST README's label table.
        "digits": False,
        "class_names": (
            "T-shirt/top",
            "Trouser",
            "Pullover",
            "Dress",
            "Coat",
            "Sandal",
            "Shirt",
            "Sneaker",
            "Bag",
            "Ankle boot",
        ),
        # Debian's dataset-fashion-mnist (0.0~git20200523.55506a9-1) installs the same four file
        # names here, but recompressed: its gz files have other MD5s (listed below, computed from
        # that package) while the IDX content is the upstream one.
        "system_dirs": ["/usr/share/datasets/fashion-mnist"],
        "alt_md5": {
            "train-images-idx3-ubyte.gz": "cf8536b0aa1a6ac5fa3f23001093305c",
            "train-labels-idx1-ubyte.gz": "10bea18fdb374794d4bb42e356e600c9",
            "t10k-images-idx3-ubyte.gz": "f78720b4224f21cce2f2ccf2d7a94c9a",
            "t10k-labels-idx1-ubyte.gz": "0d30e22e447f3c33dab9ed536400ac01",
        },
    },
    "kmnist": {
        "files": {
            "train-images-idx3-ubyte.gz": "bdb82020997e1d708af4cf47b453dcf7",
            "train-labels-idx1-ubyte.gz": "e144d726b3acfaa3e44228e80efcd344",
            "t10k-images-idx3-ubyte.gz": "5c965bf0a639b31b8f53240b1b52f4d7",
            "t10k-labels-idx1-ubyte.gz": "7320c461ea6c1c855c0b718fb2a4b134",
        },
        "mirrors": ["http://codh.rois.ac.jp/kmnist/dataset/kmnist/"],
        "counts": (60000, 10000),
    },
    # Sets in other formats ("format": the reader, capsnet.data.sources). A tar archive listed under "extract" is
    # fetched, its named members copied out (nothing else, no paths), and the archive deleted.
    # - CIFAR-10/100 binary versions: the MD5s in the table of https://www.cs.toronto.edu/~kriz/cifar.html.
    # - SVHN: torchvision's `SVHN.split_list` (github.com/pytorch/vision, torchvision/datasets/svhn.py).
    # - smallNORB: the "full" hashes of nmichlo/disent (disent/dataset/data/_groundtruth__norb.py).
    "cifar10": {
        "format": "cifar10",
        "files": {"cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530"},
        "extract": {
            "cifar-10-binary.tar.gz": [
                *(f"data_batch_{i}.bin" for i in range(1, 6)),
                "test_batch.bin",
                "batches.meta.txt",
            ],
        },
        "mirrors": ["https://www.cs.toronto.edu/~kriz/"],
        "counts": (50000, 10000),
    },
    "cifar100": {
        "format": "cifar100",
        "files": {"cifar-100-binary.tar.gz": "03b5dce01913d631647c71ecec9e9cb8"},
        "extract": {
            "cifar-100-binary.tar.gz": ["train.bin", "test.bin", "fine_label_names.txt", "coarse_label_names.txt"],
        },
        "mirrors": ["https://www.cs.toronto.edu/~kriz/"],
        "counts": (50000, 10000),
    },
    "svhn": {
        "format": "svhn",
        "files": {
            "train_32x32.mat": "e26dedcc434d2e4c54c9b2d4a06d8373",
            "test_32x32.mat": "eb5a983be6a315427106f1b164d9cef3",
        },
        "optional": {"extra_32x32.mat": "a93ce644f1a588dc4d68dda5feec44a7"},
        "options": {"extra": ["extra_32x32.mat"]},  # load_dataset("svhn", extra=True) needs the optional file
        "mirrors": ["http://ufldl.stanford.edu/housenumbers/"],
        "counts": (73257, 26032),
    },
    "smallnorb": {
        "format": "smallnorb",
        "files": {
            "smallnorb-5x46789x9x18x6x2x96x96-training-dat.mat.gz": "66054832f9accfe74a0f4c36a75bc0a2",
            "smallnorb-5x46789x9x18x6x2x96x96-training-cat.mat.gz": "23c8b86101fbf0904a000b43d3ed2fd9",
            "smallnorb-5x46789x9x18x6x2x96x96-training-info.mat.gz": "51dee1210a742582ff607dfd94e332e3",
            "smallnorb-5x01235x9x18x6x2x96x96-testing-dat.mat.gz": "e4ad715691ed5a3a5f138751a4ceb071",
            "smallnorb-5x01235x9x18x6x2x96x96-testing-cat.mat.gz": "5aa791cd7e6016cf957ce9bdb93b8603",
            "smallnorb-5x01235x9x18x6x2x96x96-testing-info.mat.gz": "a9454f3864d7fd4bb3ea7fc3eb84924e",
        },
        "mirrors": ["https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/"],
        "counts": (24300, 24300),
    },
}

# MD5s of the bundled 6,000/2,000 sample (src/capsnet/data/files/mnist-sample).
BUNDLED = "mnist-sample"  # the data set shipped in the package (data/files/mnist-sample)
BUNDLED_MD5: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "c9b62c7fd82178c2047ad09cfb53fd28",
    "train-labels-idx1-ubyte.gz": "2fa93ff07473c5b57b9f97029a2a26e2",
    "t10k-images-idx3-ubyte.gz": "7e082970898aabcdd72d63b9932d2e09",
    "t10k-labels-idx1-ubyte.gz": "0a911e44f911094d228d75fd5aa1c854",
}

# Network behaviour; module-level so tests (and impatient users) can tune them.
TRIES_PER_MIRROR = 3
RETRY_BACKOFF_S = 1.0  # doubled after each failed try
TIMEOUT_S = 20.0  # per connect / per read, not for the whole file
_CHUNK = 1 << 16


def mirror_list(name: str, mirrors: list[str] | None = None) -> list[str]:
    """Base URLs to try for `name`: `mirrors`, else `$CAPSNET_MIRRORS` (comma-separated), else defaults."""
    if mirrors is None:
        env = os.environ.get("CAPSNET_MIRRORS", "")
        mirrors = [m.strip() for m in env.split(",") if m.strip()]
        for mirror in mirrors:
            problem = url_problem(mirror)
            if problem is not None:
                raise ConfigError(
                    f"CAPSNET_MIRRORS: {mirror!r} is not an http(s):// URL ({problem}); give base URLs, comma-separated"
                )
        mirrors = mirrors or list(DATASETS[name]["mirrors"])
    return [m if m.endswith("/") else m + "/" for m in mirrors]


def md5_file(path: str | os.PathLike) -> str:
    return file_digest(path)


def known_md5s(file_name: str) -> dict[str, str]:
    """Every known MD5 of a file name: md5 -> the set it belongs to (for `capsnet data check`)."""
    out = {}
    if file_name in BUNDLED_MD5:
        out[BUNDLED_MD5[file_name]] = "mnist-sample"
    for name, info in DATASETS.items():
        for table, label in ((info["files"], name), (info.get("alt_md5", {}), f"{name} (Debian package)")):
            if file_name in table:
                out[table[file_name]] = label
    return out


def fetch(file_name: str, dest: Path, md5: str, mirrors: list[str]) -> list[str]:
    """Download one file from the first mirror that serves it whole and with the right MD5, TRIES_PER_MIRROR tries
    each. Returns [] on success, else one message per mirror saying why it failed."""
    problems = []
    for base in mirrors:
        try:
            fetch_url(
                base + file_name, dest, md5=md5, retries=TRIES_PER_MIRROR, timeout=TIMEOUT_S, backoff=RETRY_BACKOFF_S
            )
            return []
        except DownloadError as e:
            problems.append(str(e))
    return problems


def optional_files(name: str, options: dict[str, Any]) -> dict[str, str]:
    """The optional files of known set `name` (file name -> MD5) that the load `options` ask for, e.g. SVHN's
    extra_32x32.mat for extra=True."""
    info = DATASETS.get(name, {})
    wanted = [f for option, files in info.get("options", {}).items() if options.get(option) for f in files]
    return {f: info["optional"][f] for f in wanted}


def missing_files_message(name: str, folder: Path) -> str:
    files = ", ".join(DATASETS[name]["files"])
    return (
        f"put the files {files} (from {DATASETS[name]['mirrors'][0]}) in {folder}, "
        f"or pass --data-dir DIR (data_dir=DIR) pointing at a folder that holds them"
    )


def download(
    name: str, folder: Path, *, mirrors: list[str] | None = None, optional: dict[str, str] | None = None
) -> None:
    """Fetch the files of known set `name` (and the `optional` ones asked for, name -> MD5) that `folder` lacks;
    DatasetError if any cannot be had. One process at a time per folder: a process that waited for another finds
    the files there and fetches nothing."""
    urls = mirror_list(name, mirrors)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{folder.name}.lock"):
        for file_name, md5 in {**DATASETS[name]["files"], **(optional or {})}.items():
            dest = folder / file_name
            members = DATASETS[name].get("extract", {}).get(file_name)
            if members is not None and all((folder / m).is_file() for m in members):
                continue
            if members is None and (dest.exists() or (folder / file_name.removesuffix(".gz")).exists()):
                continue
            problems = fetch(file_name, dest, md5, urls)
            if problems:
                raise DatasetError(
                    f"could not download {name} ({file_name}: {'; '.join(problems)}); "
                    + missing_files_message(name, folder)
                )
            if members is not None:
                extract_members(dest, folder, members)
                dest.unlink(missing_ok=True)


def extract_members(archive: Path, folder: Path, members: list[str]) -> None:
    """Copy the regular files of tar `archive` whose base names are in `members` into `folder`, each atomically.

    Only those names are written, flat into `folder` (no member path is ever used as a path), never links.
    """
    wanted, found = set(members), set()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                base = info.name.rsplit("/", 1)[-1]
                if info.isfile() and base in wanted and base not in found:
                    src = tar.extractfile(info)
                    assert src is not None  # a regular file (info.isfile()) always has its contents
                    with atomic_open(folder / base, "wb") as out:
                        for chunk in iter(lambda: src.read(_CHUNK), b""):  # noqa: B023
                            out.write(chunk)
                    found.add(base)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(f"{archive}: not a readable tar archive ({e})") from None
    if found != wanted:
        raise DatasetError(f"{archive}: lacks {', '.join(sorted(wanted - found))}")
