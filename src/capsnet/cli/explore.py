"""`capsnet explore`: a local web page to look inside a trained model's capsules (needs `capsnet[app]`)."""

from __future__ import annotations

import argparse

from .checkpoints import add_model_arguments, model_paths


def register(subparsers) -> None:
    p = subparsers.add_parser("explore")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default 7860)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models.pretrained import load_pretrained
    from ..training.checkpoint import resolve_checkpoint
    from ..training.stuck import run_stuck_line
    from ..viz.common import run_folder_of
    from ..viz.explore import Explorer, _gradio, check_port_free, test_images

    _gradio()  # the missing extra is one line before anything loads
    check_port_free(args.host, args.port)
    (path,) = model_paths(args)
    folder = resolve_checkpoint(path)
    model = load_pretrained(folder)
    run_dir = run_folder_of(path)
    n_classes = getattr(getattr(model, "config", None), "n_classes", 0)
    note = run_stuck_line(run_dir, n_classes=n_classes) if run_dir is not None else None
    title = f"{type(model).__name__} ({path})"
    explorer = Explorer(model, images=test_images(model, folder), title=title, note=note)
    url = explorer.launch(host=args.host, port=args.port, block=False, quiet=True)
    print(f"capsnet explore: serving {url} (Ctrl-C to stop)", flush=True)
    try:
        explorer.blocks.block_thread()
    finally:
        explorer.close()
    return 0
