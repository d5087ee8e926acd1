"""Build the chapter notebooks from their percent-format sources and execute them.

    python tools/build_notebooks.py [NN ...] [--no-execute] [--jobs N]
    python tools/build_notebooks.py --stills     # stored widgets get their still pictures only

Each ``chapters/src/NN_slug.py`` becomes ``chapters/NN_slug.ipynb``, run top to bottom and
stored with its outputs, so that the stored notebook is what a learner sees and what the
tests re-execute (nbval). The reading (jupytext) and the execution (this interpreter's
kernel) are :mod:`minibatch.labs.builder`'s, the same as for the labs.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import nbformat

from minibatch.labs.builder import add_widget_stills, build_chapter

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "chapters" / "src"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapters", nargs="*", help="chapter numbers (default: all)")
    ap.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    ap.add_argument("--jobs", type=int, default=1, help="chapters built at once")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    ap.add_argument("--stills", action="store_true",
                    help="only give the stored notebooks' widgets their still pictures (nothing executed)")
    args = ap.parse_args(argv)
    sources = sorted(SRC.glob("[0-9][0-9]_*.py"))
    if args.chapters:
        sources = [s for s in sources if s.name.split("_")[0] in {c.zfill(2) for c in args.chapters}]
    if args.stills:
        for src in sources:
            path = ROOT / "chapters" / f"{src.stem}.ipynb"
            nb = nbformat.read(str(path), as_version=4)
            if add_widget_stills(nb):
                nbformat.write(nb, str(path))
                print(f"stills: {path.relative_to(ROOT)}")
        return 0
    kw = dict(timeout=args.timeout, execute_cells=not args.no_execute)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for path in pool.map(_build, sources, [kw] * len(sources)):
                print(f"wrote {path.relative_to(ROOT)}")
    else:
        for src in sources:
            print(f"wrote {_build(src, kw).relative_to(ROOT)}")
    return 0


def _build(src: Path, kw: dict) -> Path:
    return build_chapter(src, ROOT / "chapters", **kw)


if __name__ == "__main__":
    sys.exit(main())
