# A package, so that this directory's conftest.py is imported as ``kernels.conftest``
# and does not replace ``tests/conftest.py`` as the top-level module named ``conftest``.
