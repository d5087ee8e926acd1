"""``python -m minibatch.presets [NAME ...]``: print the knobs each preset sets (default: all)."""

from __future__ import annotations

import sys

from minibatch.presets import PRESETS, describe


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or list(PRESETS)
    try:
        print("\n\n".join(describe(n) for n in names))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
