"""pytest on labs/: nbval runs the answer keys (labs/keys/*.key.ipynb) top to bottom.

The learner notebooks (labs/LNN_slug.ipynb) hold stubs that raise NotImplementedError at
every check cell by design; tests/test_labs.py checks exactly that (each check cell fails
with its task's NotImplementedError), and ``python -m minibatch.labs check`` grades them.
Running them under nbval would only report those intended failures.
"""

collect_ignore_glob = ["L[0-9][0-9]_*.ipynb"]
