"""Build the demo models: ``python -m models.build [--repository DIR | --out DIR] [NAMES]``.

By default writes ``<repository>/<name>/1/model.onnx`` (the model repository the
demo serves, beside its committed ``config.toml``); with ``--out`` writes
``<out>/<name>.onnx`` instead. Only missing files are built (all with ``--force``),
by calling ``models.<name>.build``; one line per model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.servable import servable_module

DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "repository"
DEFAULT_NAMES = ("classifier", "mlp", "tiny", "detector")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.build", description=__doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository folder"
    )
    where.add_argument("--out", type=Path, default=None, help="a flat output folder instead")
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
        if args.out is not None:
            path: Path = args.out / f"{name}.onnx"
        else:
            path = args.repository / name / "1" / "model.onnx"
        if path.exists() and not args.force:
            print(f"skipped {name}: {path} exists (--force rebuilds it)")
            continue
        module.build(path)
        print(f"built {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
