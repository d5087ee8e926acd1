"""Write the course map's generated files from :mod:`minibatch.labs.course`.

    python tools/build_course_map.py [--check]

* ``COURSE.md``: the landing page that ``make course`` opens first (the map of all 30
  chapters and 10 labs, how to grade a lab, where the data comes from);
* the table of chapters in ``README.md``, between the ``course-map`` markers.

Run it after adding or renaming a chapter or a lab; ``--check`` only says whether the files
are up to date (exit 1 if not), as ``tests/test_course_map.py`` does. The book's sidebar
(``make book``) is made from the same map at build time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minibatch.labs.course import landing_page, with_readme_table

ROOT = Path(__file__).resolve().parents[1]


def expected() -> dict[Path, str]:
    readme = ROOT / "README.md"
    return {ROOT / "COURSE.md": landing_page(ROOT),
            readme: with_readme_table(readme.read_text(encoding="utf-8"), ROOT)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = ap.parse_args(argv)
    stale = []
    for path, text in expected().items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print("out of date: " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
              + " (run python tools/build_course_map.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
