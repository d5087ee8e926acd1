"""Sphinx configuration of the course as a static book (``make book``, ``tools/build_book.py``).

The sources are staged by ``tools/build_book.py`` into ``_build/book-src/`` (the landing page
with the sidebar's toctrees, the chapter and lab notebooks, two reference pages) and built
with ``sphinx-build -c book``. Notebooks are rendered from their stored outputs (MyST-NB,
never executed). Everything the pages load is local: MathJax 3 comes from the
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
