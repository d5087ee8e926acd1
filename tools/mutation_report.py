"""Mutation score per module from a finished ``mutmut run`` (``make mutate`` prints it).

    python tools/mutation_report.py [--root DIR] [--survivors]

Score = killed / (mutants checked; a run stopped early leaves some "not checked"); a timeout counts as killed (the planted bug hung a test that
the default pytest timeout then failed), "no tests" and "survived" count against it. Every
survivor must be killed by a test or listed as equivalent, with its reason, in one of
``tests/mutants/*.md`` (one file per area of the core); ``--survivors`` lists the survivors
not explained there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLED = {1, 3, 36, -24, 24, 152, 255}        # mutmut's codes for a failing test or a timeout
SURVIVED, NO_TESTS = {0}, {5, 33}


def load(root: Path) -> dict[str, dict[str, int | None]]:
    out = {}
    for meta in sorted((root / "mutants").rglob("*.py.meta")):
        module = meta.relative_to(root / "mutants").as_posix()[:-len(".meta")]
        out[module] = json.loads(meta.read_text())["exit_code_by_key"]
    return out


def explained(root: Path) -> set[str]:
    """Mutant names listed (in backticks) as equivalent in ``tests/mutants/*.md``."""
    names: set[str] = set()
    for path in sorted((root / "tests" / "mutants").glob("*.md")):
        names |= set(re.findall(r"`([\wǁ.]+__mutmut_\d+)`", path.read_text(encoding="utf-8")))
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT), help="the checkout mutmut ran in")
    ap.add_argument("--survivors", action="store_true", help="list survivors not explained in tests/mutants/*.md")
    args = ap.parse_args(argv)
    root = Path(args.root)
    data = load(root)
    if not data:
        print("no mutmut results under", root / "mutants", file=sys.stderr)
        return 2
    known = explained(root)
    rows, total = [], Counter()
    unexplained = []
    for module, codes in data.items():
        if not codes:
            continue
        c = Counter()
        for key, code in codes.items():
            kind = ("killed" if code in KILLED else "survived" if code in SURVIVED
                    else "no tests" if code in NO_TESTS else "not checked" if code is None else "other")
            if kind in ("survived", "no tests") and key in known:
                kind = "equivalent"
            elif kind in ("survived", "no tests"):
                unexplained.append(key)
            c[kind] += 1
        c["total"] = len(codes)
        total.update(c)
        rows.append((module, c))
    # A run stopped early leaves mutants "not checked": the scores count only the checked ones.
    print("| module | mutants | not checked | killed | equivalent | survived | no tests | score | "
          "score, equivalents excluded |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for module, c in rows + [("all", total)]:
        checked = c["total"] - c["not checked"]
        live = checked - c["equivalent"]
        score = f"{c['killed'] / checked:.1%}" if checked else "-"
        live_score = f"{c['killed'] / live:.1%}" if live else "-"      # nothing checked: no score
        print(f"| {module} | {c['total']} | {c['not checked']} | {c['killed']} | {c['equivalent']} | {c['survived']} | "
              f"{c['no tests']} | {score} | {live_score} |")
    if args.survivors:
        print(f"\n{len(unexplained)} survivors not listed in tests/mutants/*.md:")
        for key in unexplained:
            print(" ", key)
        # A listed name that a test killed, or that no longer exists, points at another mutant now:
        # mutmut numbers a function's mutants in order, so an edit to the function renumbers them.
        codes = {key: code for module_codes in data.values() for key, code in module_codes.items()}
        stale = sorted(n for n in known if n.startswith("minibatch.") and (n not in codes or codes[n] in KILLED))
        if stale:
            print(f"\n{len(stale)} listed as equivalent but killed or unknown (renumbered? compare `mutmut show`):")
            for key in stale:
                print(" ", key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
