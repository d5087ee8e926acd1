"""nbval-graded labs: find them, build their notebooks, grade a learner's notebook.

Each lab has one source, ``labs/src/LNN_slug.py`` (format: :mod:`minibatch.labs.source`),
from which ``python -m minibatch.labs build`` writes

* ``labs/LNN_slug.ipynb``: the learner notebook (task stubs, reference outputs);
* ``labs/keys/LNN_slug.key.ipynb``: the answer key (reference solution, executed).

``python -m minibatch.labs check LNN PATH.ipynb`` reruns the learner's task cells with
the key's own setup and check cells and compares the check cells' outputs with the key
(:mod:`minibatch.labs.grader`); ``solve`` writes the solved notebook for teachers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SOURCE_RE = re.compile(r"^(L\d\d)_([A-Za-z0-9_]+)\.py$")


def labs_dir() -> Path:
    """The repository's ``labs/`` folder (``MINIBATCH_LABS_DIR`` overrides it)."""
    from minibatch.config import env
    override = env("MINIBATCH_LABS_DIR")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parents[2] / "labs"


@dataclass(frozen=True)
class Lab:
    lab_id: str          # "L03"
    slug: str            # "continuous"
    root: Path           # the labs/ folder

    @property
    def name(self) -> str:
        return f"{self.lab_id}_{self.slug}"

    @property
    def source_path(self) -> Path:
        return self.root / "src" / f"{self.name}.py"

    @property
    def notebook_path(self) -> Path:
        return self.root / f"{self.name}.ipynb"

    @property
    def key_path(self) -> Path:
        return self.root / "keys" / f"{self.name}.key.ipynb"

    def source(self):
        from minibatch.labs.source import parse
        return parse(self.source_path, self.lab_id)


def list_labs(root: str | Path | None = None) -> list[Lab]:
    root = Path(root) if root is not None else labs_dir()
    out = []
    for p in sorted((root / "src").glob("L*.py")):
        m = SOURCE_RE.match(p.name)
        if m:
            out.append(Lab(m.group(1), m.group(2), root))
    return out


def find_lab(name: str, root: str | Path | None = None) -> Lab:
    """A lab by ``"L03"``, ``"l3"``, ``"3"`` or ``"L03_continuous"``."""
    labs = list_labs(root)
    m = re.fullmatch(r"[Ll]?0*(\d+)(?:_.*)?", name.strip())
    if m:
        want = f"L{int(m.group(1)):02d}"
        for lab in labs:
            if lab.lab_id == want:
                return lab
    known = ", ".join(l.lab_id for l in labs) or "none"
    raise KeyError(f"no lab {name!r} (labs: {known})")


def grade(lab: str | Lab, notebook: str | Path, **kwargs):
    """Grade a learner notebook; see :func:`minibatch.labs.grader.grade`."""
    from minibatch.labs.grader import grade as _grade
    return _grade(find_lab(lab) if isinstance(lab, str) else lab, notebook, **kwargs)


__all__ = ["Lab", "labs_dir", "list_labs", "find_lab", "grade"]
