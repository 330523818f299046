"""torch.hub entry points: one for every model in capsnet's registry (capsnet.models.registry), under the name
`capsnet train --model` takes and, for names with "-", its spelling with "_" too. Each is
`capsnet.create_model(NAME, pretrained=..., **options)`:

    torch.hub.load(REPO_DIR, "capsnet", source="local")                                   # fresh, the paper's config
    torch.hub.load(REPO_DIR, "efficient-capsnet", source="local", pretrained="mnist-sample")  # shipped weights
    torch.hub.load(REPO_DIR, "capsnet", source="local", pretrained="hf-hub:ORG/REPO")    # a Hub repository

`pretrained` takes what create_model's does (a shipped tag, a folder, URL#sha256=HEX, hf-hub:ORG/REPO[@REVISION]);
`options` are config fields. The package is imported from this folder's src/ unless capsnet is imported already.
"""

import sys as _sys
from pathlib import Path as _Path

dependencies = ["torch", "numpy", "safetensors", "tqdm"]

_SOURCE = str(_Path(__file__).resolve().parent / "src")
if _SOURCE not in _sys.path:
    _sys.path.insert(0, _SOURCE)


def _entry(name: str, cls: type):
    """The entry point of registered model `name` (class `cls`)."""

    def entry(*, pretrained=None, **options):
        from capsnet.models.factory import create_model

        return create_model(name, pretrained=pretrained, **options)

    entry.__name__ = entry.__qualname__ = name.replace("-", "_")
    paper = getattr(cls, "paper", "")
    entry.__doc__ = (
        f"{cls.__name__}{f' ({paper})' if paper else ''}: capsnet.create_model({name!r}, pretrained=..., "
        "**options); pretrained: a shipped tag, a folder, URL#sha256=HEX or hf-hub:ORG/REPO[@REVISION]."
    )
    return entry


def _register_all() -> None:
    import capsnet.models  # noqa: F401  (importing capsnet.models fills the registry)
    from capsnet.models.registry import MODELS

    for name in MODELS:
        entry = _entry(name, MODELS[name])
        globals()[name] = entry
        globals()[name.replace("-", "_")] = entry


_register_all()
