"""``python -m minibatch.labs {list,build,check,solve,course}``.

    list                          the labs and their tasks
    build [LAB ...]               rebuild learner notebooks and answer keys from labs/src/
    check LAB NOTEBOOK [--json]   grade a notebook; exit 0 iff every task passes
    solve LAB --out PATH          write the reference-solved notebook (for teachers)
    course [--port N] [--host H]  open the course in JupyterLab (what `make course` runs;
                                  see minibatch.labs.launch)
    reset NN|LNN [--workdir DIR]  put one notebook of your working copy (workspace/) back as
                                  shipped; yours is kept as *.ipynb.bak
"""

from __future__ import annotations

import argparse
import shutil
import sys


def _cmd_list(args) -> int:
    from minibatch.labs import list_labs

    for lab in list_labs():
        src = lab.source()
        titles = src.task_titles()
        print(src.title if src.title.startswith(lab.lab_id) else f"{lab.lab_id}  {src.title}")
        print(f"     notebook: labs/{lab.notebook_path.name}")
        for t in src.tasks:
            print(f"     task {t}: {titles.get(t, '')}")
    return 0


def _cmd_build(args) -> int:
    from minibatch.labs import find_lab, list_labs
    from minibatch.labs.builder import build_lab

    labs = [find_lab(n) for n in args.labs] if args.labs else list_labs()
    for lab in labs:
        build_lab(lab, timeout=args.timeout)
    return 0


def _cmd_check(args) -> int:
    from minibatch.labs import find_lab
    from minibatch.labs.grader import grade

    try:
        report = grade(find_lab(args.lab), args.notebook, timeout=args.timeout, tasks=args.task or None)
    except ValueError as e:                  # an unknown task number
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.format())
    return 0 if report.passed else 1


def _cmd_solve(args) -> int:
    from minibatch.labs import find_lab

    lab = find_lab(args.lab)
    if args.execute:
        import nbformat

        from minibatch.labs.builder import clean_outputs, execute, make_notebook

        nb = make_notebook(lab.source(), "reference")
        execute(nb, cwd=lab.root, timeout=args.timeout)
        clean_outputs(nb)
        nbformat.write(nb, args.out)
    else:
        shutil.copyfile(lab.key_path, args.out)
    print(f"wrote the solved {lab.lab_id} notebook to {args.out}")
    return 0


def _cmd_reset(args) -> int:
    from pathlib import Path

    from minibatch.labs.launch import WORKDIR, course_root, reset_notebook

    root = course_root(None)
    work = Path(args.workdir) if args.workdir else root / WORKDIR
    dest, backup = reset_notebook(root, work, args.notebook)
    print(f"restored {dest}" + (f" (your copy: {backup})" if backup else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["course"]:                   # its own parser: python -m minibatch.labs course --help
        from minibatch.labs.launch import main as course

        return course(argv[1:])
    p = argparse.ArgumentParser(prog="python -m minibatch.labs", description="minibatch labs: build, check, solve")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the labs and their tasks").set_defaults(fn=_cmd_list)
    b = sub.add_parser("build", help="rebuild learner notebooks and answer keys from labs/src")
    b.add_argument("labs", nargs="*", help="lab ids (default: all)")
    b.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    b.set_defaults(fn=_cmd_build)
    c = sub.add_parser("check", help="grade a notebook against the lab's answer key")
    c.add_argument("lab", help="lab id, e.g. L03")
    c.add_argument("notebook", help="your notebook (.ipynb)")
    c.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--task", type=int, action="append",
                   help="grade only this task (and the tasks its checks need); repeat for several")
    c.set_defaults(fn=_cmd_check)
    s = sub.add_parser("solve", help="write the reference-solved notebook")
    s.add_argument("lab")
    s.add_argument("--out", required=True)
    s.add_argument("--execute", action="store_true", help="run the reference now instead of copying the key")
    s.add_argument("--timeout", type=int, default=300)
    s.set_defaults(fn=_cmd_solve)
    r = sub.add_parser("reset", help="put one notebook of your working copy back as shipped")
    r.add_argument("notebook", help="chapter number (05) or lab id (L03)")
    r.add_argument("--workdir", help="your working copy (default: workspace/ in the checkout)")
    r.set_defaults(fn=_cmd_reset)
    sub.add_parser("course", help="open the course in JupyterLab (what `make course` runs)")
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
