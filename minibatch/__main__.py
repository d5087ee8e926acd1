"""Command line: ``python -m minibatch {generate,serve,router,bench,simulate,profile}``.

    generate   run prompts through the offline API (``LLM.generate``) and print the text
    serve      an OpenAI-compatible HTTP server (minibatch.serving.server); ``--replicas N``: N of
               them behind the router (minibatch.serving.replicas)
    router     an OpenAI-compatible HTTP router in front of OpenAI servers (minibatch.serving.router)
    bench      ``bench serve``: a load generator for any OpenAI-compatible server (minibatch.bench)
    simulate   replay a trace or named workload in the simulator (minibatch.sim.cli)
    profile    time the real engine's steps and fit the simulator's cost model (minibatch.sim.calibrate)

Engine options are the same flags everywhere, one per ``EngineConfig`` field
(``minibatch.config.add_engine_args``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from minibatch.config import add_engine_args, engine_kwargs

# Subcommands with a parser of their own: the rest of the command line is handed over.
DELEGATED = {"serve": "minibatch.serving.server", "router": "minibatch.serving.router", "bench": "minibatch.bench",
             "simulate": "minibatch.sim.cli", "profile": "minibatch.sim.calibrate"}


def cmd_generate(args: argparse.Namespace) -> int:
    from minibatch import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.sample_seed,
                            stop=args.stop)
    prompts = args.prompt or ["Once upon a time"]
    for out in llm.generate(prompts, params):
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            continue
        m = out.metrics
        print(f"{out.prompt}{out.outputs[0].text}")
        print(f"  [{m.output_len} tokens, finish_reason={out.outputs[0].finish_reason}, "
              f"TTFT {m.ttft * 1000:.1f} ms, E2E {m.e2e * 1000:.1f} ms]", file=sys.stderr)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minibatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    for name, module in DELEGATED.items():
        sub.add_parser(name, help=f"see python -m minibatch {name} --help ({module})", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        # Hand the rest over untouched: argparse's REMAINDER rejects a leading option (--port ...).
        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
