"""The course map (minibatch/labs/course.py) agrees with the notebooks that exist, and the
files made from it (COURSE.md, README.md's table) are up to date."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from minibatch.labs import list_labs
from minibatch.labs.course import (COMING, LAB_CHECK, LABS, STAGES, chapter_files, chapter_titles, lab_files,
                                   notebook_title, title_in_notebook)

ROOT = Path(__file__).resolve().parents[1]


def _build_course_map():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_course_map
    finally:
        sys.path.pop(0)
    return build_course_map


def test_map_shape():
    numbers = [n for s in STAGES for n, _ in s.chapters]
    assert numbers == list(range(1, 34)), "33 chapters, numbered in order across the four stages"
    assert [s.span for s in STAGES] == ["第 1–8 章", "第 9–20 章", "第 21–30 章", "第 31–33 章"]
    assert [lab.lab_id for lab in LABS] == [f"L{i:02d}" for i in range(1, 11)]
    assert all(set(lab.chapters) <= set(numbers) for lab in LABS)


@pytest.mark.parametrize("number,path", sorted(chapter_files().items()))
def test_every_chapter_notebook_is_in_the_map_under_its_title(number, path):
    titles = chapter_titles()
    assert number in titles, f"{path} is not in minibatch/labs/course.py"
    heading = notebook_title(ROOT / path)
    assert re.match(rf"第\s*{number}\s*章", heading), heading
    assert title_in_notebook(heading) == titles[number], \
        f"{path} is titled {heading!r}; the course map says {titles[number]!r}"


def test_every_chapter_source_has_its_notebook():
    built = {Path(p).stem for p in chapter_files().values()}
    for src in (ROOT / "chapters" / "src").glob("[0-9][0-9]_*.py"):
        assert src.stem in built, f"{src.name} has no notebook: run tools/build_notebooks.py {src.stem[:2]}"


@pytest.mark.parametrize("lab_id,path", sorted(lab_files().items()))
def test_every_lab_notebook_is_in_the_map_under_its_title(lab_id, path):
    entry = {lab.lab_id: lab for lab in LABS}.get(lab_id)
    assert entry is not None, f"{path} is not in minibatch/labs/course.py"
    assert title_in_notebook(notebook_title(ROOT / path)) == entry.title
    assert lab_id in {lab.lab_id for lab in list_labs()}, f"{path} has no source in labs/src/"


def test_generated_files_are_up_to_date():
    stale = [p.name for p, text in _build_course_map().expected().items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"{stale} out of date with minibatch/labs/course.py: run python tools/build_course_map.py"


def test_landing_page_maps_the_whole_course_with_live_links_only():
    text = (ROOT / "COURSE.md").read_text(encoding="utf-8")
    for n, title in chapter_titles().items():
        assert title in text, f"chapter {n} missing from COURSE.md"
    for lab in LABS:
        assert lab.title in text, f"{lab.lab_id} missing from COURSE.md"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "no links"
    for link in links:
        assert not link.startswith(("http:", "https:")), link
        assert (ROOT / link).exists(), f"COURSE.md links to {link}, which does not exist"
    linked = set(links)
    assert set(chapter_files().values()) <= linked and set(lab_files().values()) <= linked
    assert LAB_CHECK in text and "datasets/README.md" in linked and "labs/README.md" in linked
    assert "src/" not in "".join(linked)


def test_only_what_has_no_notebook_is_announced_as_coming():
    """The syllabus's 30 chapters and 10 labs are all written; what the landing page and the README
    announce as coming is exactly the chapters (of the frontier stage) that have no notebook yet."""
    chapters, titles = chapter_files(), chapter_titles()
    assert set(range(1, 31)) <= set(chapters) and len(lab_files()) == len(LABS), "the syllabus is complete"
    missing = [n for n in titles if n not in chapters]
    course = (ROOT / "COURSE.md").read_text(encoding="utf-8")
    announced = re.findall(rf"^\| (\d\d) \| [^|\n]*{COMING}", course, flags=re.M)
    assert sorted(int(n) for n in announced) == missing, "COURSE.md: coming = the chapters without a notebook"
    intro = 1 if missing else 0                      # "其余标为“即将推出”" in the opening paragraph
    assert course.count(COMING) == len(missing) + intro, "nothing else (no lab, no written chapter) is coming"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    if missing:
        assert "Coming, in the same form: chapter" in readme     # "chapter 32", "chapters 31-32"
        for n in missing:
            assert f"{n:02d}" in readme.split("Coming, in the same form:")[1].split(".")[0]
    else:
        assert "coming" not in readme.lower()
