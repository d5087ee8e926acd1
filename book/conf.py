"""Sphinx configuration of the course as a static book (``make book``, ``tools/build_book.py``).

The sources are staged by ``tools/build_book.py`` into ``_build/book-src/`` (the landing page
with the sidebar's toctrees, the chapter and lab notebooks, two reference pages) and built
with ``sphinx-build -c book``. Notebooks are rendered from their stored outputs (MyST-NB,
never executed). Markdown that a cell prints (``display(Markdown(...))``) is rendered as
GitHub-flavoured Markdown, so its tables become tables. Search works in Chinese: jieba (the
``book`` extra) splits the text into words for the index, and the search page gets a working
stemmer (see :class:`ChineseSearch`). Everything the pages load is local: MathJax 3 comes from the
``sphinx-mathjax-offline`` package, the theme's fonts and scripts from the theme, and no
ipywidgets script is added, so the built site works from ``file://`` without a network.
"""

project = "minibatch：LLM 推理服务中的动态批处理"
author = "minibatch"
copyright = "minibatch authors, Apache-2.0"
language = "zh_CN"

extensions = [
    "myst_nb",
    "sphinx-mathjax-offline",        # copies MathJax 3 into _static/mathjax and points mathjax_path at it
]
root_doc = "index"
exclude_patterns = ["**/.ipynb_checkpoints"]

# MyST-NB: stored outputs only; $...$ and $$...$$ as in JupyterLab.
nb_execution_mode = "off"
nb_ipywidgets_js = {}                # no require.js / widget manager from a CDN
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
# text/markdown outputs: MyST-NB 1.4 renders them as plain CommonMark by default, which has no
# tables, so the 96 tables that cells print showed as raw "|---|" lines (myst_nb/core/config.py,
# render_markdown_format). GFM has tables; those outputs hold no math.
nb_render_markdown_format = "gfm"
myst_heading_anchors = 3
suppress_warnings = ["misc.highlighting_failure"]

html_theme = "sphinx_book_theme"
html_title = "minibatch 课程"
html_static_path = ["_static"]
html_css_files = ["cjk.css"]
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "use_download_button": True,     # the page's .ipynb, from the build itself
    "use_fullscreen_button": False,
    "search_bar_text": "搜索本课程…",
}
html_last_updated_fmt = None
html_show_sourcelink = False
html_copy_source = True              # the download button serves _sources/*.ipynb
# The search page would fetch each hit's page for a summary line; from file:// the browser
# refuses (CORS), one console error per hit. Titles only.
html_show_search_summary = False


# Search in Chinese. Sphinx's zh search (sphinx/search/zh.py) splits Chinese text with jieba
# when it is installed (without it the index holds no Chinese word at all) and stems Latin words
# with the English Snowball stemmer. Sphinx 9.0 writes ``window.Stemmer = ChineseStemmer;`` into
# the search page's language_data.js (IndexBuilder.get_js_stemmer_code names the class after
# ``language_name``), a class that does not exist, so every search stops with "ReferenceError:
# ChineseStemmer is not defined" (sphinx-doc/sphinx issue 14229; fixed by pull request 14416,
# which derives the class from the stemmer's file name). ChineseSearch hands the page the
# stemmer it really uses, EnglishStemmer, the JavaScript twin of the one that built the index.
import logging                                   # noqa: E402

from sphinx.search import zh as _zh              # noqa: E402

try:
    import jieba
    jieba.setLogLevel(logging.WARNING)           # not "Building prefix dict ..." on every build
except ImportError:                              # the book extra installs it; without it, no Chinese words
    jieba = None


class ChineseSearch(_zh.SearchChinese):
    js_stemmer_rawcode = ""                      # no separate non-minified copy; the code is below

    @property
    def js_stemmer_code(self) -> str:
        from sphinx.search import _MINIFIED_JS_PATH as js
        return "\n".join([(js / "base-stemmer.js").read_text(encoding="utf-8"),
                          (js / "english-stemmer.js").read_text(encoding="utf-8"),
                          "window.Stemmer = EnglishStemmer;"])


def setup(app):
    if jieba is None:
        logging.getLogger(__name__).warning(
            'jieba is not installed: the search index will hold no Chinese words (pip install -e ".[book]")')
    app.add_search_language(ChineseSearch)
