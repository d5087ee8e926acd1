"""Order of the test run: the chapter notebooks first, later (heavier, simulated stage-3) chapters
before earlier ones, then tests/ in its usual order.

``make test`` spreads whole files over two workers (pytest-xdist ``--dist loadfile``) in collection
order. Collected as ``testpaths`` lists them, the notebooks of chapters 19-30 (one to four minutes
each) came last, so the run ended with one worker on a long notebook and the other idle; started
first, they overlap each other and the short test files fill the end.
"""

from __future__ import annotations

import re


def _chapter_number(item) -> int | None:
    m = re.search(r"(?:^|/)chapters/(\d\d)_[^/]*\.ipynb$", item.nodeid.split("::")[0])
    return int(m.group(1)) if m else None


def pytest_collection_modifyitems(session, config, items):
    rank = {id(it): (0, -n) if (n := _chapter_number(it)) is not None else (1, 0) for it in items}
    items[:] = sorted(items, key=lambda it: rank[id(it)])     # stable: within a file, cells keep their order
