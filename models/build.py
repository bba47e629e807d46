"""Build the demo models: ``python -m models.build [--out DIR] [--force] [NAMES...]``.

Writes ``<out>/<name>.onnx`` for each named servable whose file is missing (all of
them with ``--force``) by calling ``models.<name>.build``; one line per model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.servable import servable_module

DEFAULT_OUT = Path("build/models")
DEFAULT_NAMES = ("classifier", "mlp", "tiny")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.build", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--force", action="store_true", help="rebuild files that exist")
    parser.add_argument("names", nargs="*", default=list(DEFAULT_NAMES), metavar="NAME")
    args = parser.parse_args(argv)
    # Resolve every name first: a typo fails before any file is written.
    modules = {}
    for name in args.names:
        try:
            modules[name] = servable_module(name)
        except ValueError as exc:
            parser.error(str(exc))
    for name, module in modules.items():
        path: Path = args.out / f"{name}.onnx"
        if path.exists() and not args.force:
            print(f"skipped {name}: {path} exists (--force rebuilds it)")
            continue
        module.build(path)
        print(f"built {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
