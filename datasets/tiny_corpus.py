"""CLI for the procedural tiny-model corpus (generator core: ``minibatch/tiny/corpus.py``).

    python datasets/tiny_corpus.py --out DIR --n N --seed S [--heldout-frac F] [--print K]

Writes DIR/train.jsonl (N documents) and DIR/heldout.jsonl (held-out
character/place combinations, different random stream), one
{"text": ...} object per line.  Deterministic for a given seed.
The generator needs only the standard library; ``import minibatch`` imports nothing heavy.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # run from a checkout
from minibatch.tiny.corpus import generate, write_corpus  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--print", type=int, default=0, help="also print K sample documents")
    args = ap.parse_args(argv)
    counts = write_corpus(args.out, args.n, args.seed, args.heldout_frac)
    print(f"wrote {counts} to {args.out}")
    for d in generate(args.print, args.seed):
        print(d, end="\n<|endoftext|>\n")


if __name__ == "__main__":
    main()
