"""The course as a static book (``make book`` = ``tools/build_book.py``).

Builds the book once per session (strict: a Sphinx warning, e.g. a broken internal link or a
missing image, fails it), checks the site is self-contained, then opens it from ``file://``
in headless Chromium the way a reader does: the landing page, its link to chapter 01, a
figure and a formula on that page; and searches it there, in Chinese and in English.
Screenshots go to ``artifacts/book/`` (or ``$MINIBATCH_ARTIFACTS``). Skipped when the ``book``
extra (Sphinx, MyST-NB) is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
CHAPTER_01_HEADING = "课程导入：动态批处理的价值与挑战"

pytestmark = pytest.mark.slow


def _tools():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_book
    finally:
        sys.path.pop(0)
    return build_book


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> Path:
    for mod in ("sphinx", "myst_nb", "sphinx_book_theme"):
        pytest.importorskip(mod, reason='the book extra is not installed (pip install -e ".[book]")')
    tmp = tmp_path_factory.mktemp("book")
    return _tools().build(tmp / "site", strict=True, src=tmp / "src").parent


def test_book_has_every_page_and_needs_no_network(book):
    from minibatch.labs.course import STAGES, chapter_files, lab_files

    for rel in [*chapter_files().values(), *lab_files().values()]:
        assert (book / rel.replace(".ipynb", ".html")).exists(), rel
    index = (book / "index.html").read_text(encoding="utf-8")
    for stage in STAGES:                                       # the sidebar: the three stages
        assert stage.title in index, stage.title
    assert 'href="chapters/01_intro.html"' in index
    assert (book / "_static" / "mathjax" / "tex-chtml.js").exists()
    external = re.compile(r'<(?:script|link|img|iframe)[^>]*(?:src|href)="(?:https?:)?//', re.I)
    for page in book.rglob("*.html"):
        assert not external.search(page.read_text(encoding="utf-8")), f"{page} loads from the network"
    chapter = (book / "chapters" / "01_intro.html").read_text(encoding="utf-8")
    assert CHAPTER_01_HEADING in chapter and 'class="math' in chapter and "<img" in chapter
    assert "widget-view+json" not in chapter                   # widgets became a note


def test_book_in_a_browser(book):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    from playwright.sync_api import sync_playwright

    from minibatch.config import env
    shots = Path(env("MINIBATCH_ARTIFACTS") or ROOT / "artifacts") / "book"
    shots.mkdir(parents=True, exist_ok=True)
    remote = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
                    else remote.append(r.url))
            page.goto((book / "index.html").as_uri(), wait_until="load", timeout=60_000)
            assert "动态批处理" in page.locator("article h1").first.inner_text()
            nav = page.locator("nav.bd-links").inner_text()
            assert "基础原理篇" in nav and "工程实践篇" in nav and "生产进阶篇" in nav, nav[:300]
            page.wait_for_timeout(500)
            page.screenshot(path=str(shots / "index.png"))

            page.locator("article a", has_text=CHAPTER_01_HEADING).first.click()
            page.wait_for_url("**/chapters/01_intro.html*", timeout=60_000)
            assert CHAPTER_01_HEADING in page.locator("article h1").first.inner_text()
            # A formula typeset by the bundled MathJax, without errors.
            page.wait_for_selector("article mjx-container", timeout=60_000)
            assert page.locator("article mjx-merror").count() == 0
            formula = page.locator("article mjx-container[display='true']").first
            formula.scroll_into_view_if_needed()
            assert formula.bounding_box()["width"] > 50
            page.wait_for_timeout(500)
            page.screenshot(path=str(shots / "chapter01_formula.png"))
            # A figure from the stored outputs, loaded.
            img = page.locator("article .cell_output img").first
            img.scroll_into_view_if_needed()
            page.wait_for_function("(el) => el.complete && el.naturalWidth > 0", arg=img.element_handle(),
                                   timeout=30_000)
            page.wait_for_timeout(500)
            page.screenshot(path=str(shots / "chapter01_figure.png"))
            text = page.locator("article").inner_text()
            assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 1000      # the Chinese prose is there
        finally:
            browser.close()
    assert not remote, f"the book asked the network for {remote[:5]}"


def _search_index(book: Path) -> dict:
    text = (book / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1:text.rindex(")")])


def test_search_index_holds_chinese_words_and_the_page_a_stemmer_that_exists(book):
    terms = _search_index(book)["terms"]
    chinese = [t for t in terms if re.search(r"[\u4e00-\u9fff]", t)]
    assert len(chinese) > 1000, f"{len(chinese)} Chinese terms in the search index (is jieba installed?)"
    for word in ("抢占", "批处理", "调度", "吞吐", "显存"):
        assert word in terms, word
    assert "prefil" in terms                                 # "prefill", stemmed as the page stems a query
    # The search page's stemmer: the class language_data.js hands to searchtools.js must be defined there
    # (Sphinx 9.0 names a ChineseStemmer that does not exist; sphinx-doc/sphinx issue 14229).
    lang = (book / "_static" / "language_data.js").read_text(encoding="utf-8")
    stemmer = re.search(r"window\.Stemmer\s*=\s*(\w+)", lang).group(1)
    assert re.search(rf"\b{stemmer}\s*=\s*function|\b(?:class|function)\s+{stemmer}\b", lang), stemmer


def test_no_page_shows_a_raw_markdown_table(book):
    raw = {}
    for page in sorted(book.rglob("*.html")):
        n = page.read_text(encoding="utf-8").count("|---")
        if n:
            raw[str(page.relative_to(book))] = n
    assert not raw, (f"Markdown tables shown as raw '|---' lines: {raw} (a cell must display a table "
                     "with minibatch.viz.md_table, not print it; the book renders text/markdown as GFM)")


def test_a_dashboard_shows_its_picture_in_the_book(book):
    page = (book / "chapters" / "01_intro.html").read_text(encoding="utf-8")
    note = page.index("交互部件（Widget）")
    cell = [m.start() for m in re.finditer(r'<div class="cell(?: [^"]*)?"', page[:note])][-1]   # its cell
    assert page.rfind("<img", 0, note) > cell, "chapter 01's dashboard has no picture in the book"


def test_book_search_in_a_browser(book):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    from playwright.sync_api import sync_playwright

    errors = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: errors.append(str(e)))
            for query, title_word in (("抢占", "抢占"), ("prefill", "Prefill")):
                page.goto((book / "search.html").as_uri() + "?q=" + urllib.parse.quote(query),
                          wait_until="load", timeout=60_000)
                page.wait_for_selector("#search-results ul.search li a", timeout=60_000)
                titles = page.locator("#search-results ul.search li a").all_inner_texts()
                assert len(titles) >= 3, (query, titles)
                assert any(title_word in t for t in titles), (query, titles[:10])
        finally:
            browser.close()
    assert not errors, errors
