"""Command line: ``python -m minibatch {generate,serve,bench,simulate,profile,demo}``."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names where vLLM has one."""
    p.add_argument("--model", default="tiny", help="'tiny' (embedded) or a local HF checkpoint directory")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--policy", "--scheduling-policy", dest="policy", default=None)
    p.add_argument("--max-wait", dest="max_wait", default=None, help="batching window, e.g. 30ms or 0.03s")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    p.add_argument("--swap-space-blocks", type=int, default=None)
    p.add_argument("--admission", default=None, help="max_utilization | guaranteed_no_evict | conservative")
    p.add_argument("--kv-allocator", choices=["paged", "contiguous"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=None)


def parse_duration_ms(text: str | float | None) -> float | None:
    """``"30ms"``, ``"0.03s"`` or a bare number of milliseconds -> milliseconds."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    t = text.strip().lower()
    try:
        if t.endswith("ms"):
            return float(t[:-2])
        if t.endswith("s"):
            return float(t[:-1]) * 1000.0
        return float(t)
    except ValueError:
        raise ValueError(f"cannot read duration {text!r}; write e.g. 30ms or 0.03s") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = ["model", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
             "enable_chunked_prefill", "enable_prefix_caching", "policy", "preemption_mode", "device",
             "swap_space_blocks", "admission", "kv_allocator",
             "dtype", "seed"]
    kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    wait = parse_duration_ms(getattr(args, "max_wait", None))
    if wait is not None:
        kw["max_wait_ms"] = wait
    return kw


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
        print(f"  [{m.num_output_tokens} tokens, finish_reason={out.outputs[0].finish_reason}, "
              f"TTFT {m.ttft * 1000:.1f} ms, E2E {m.e2e * 1000:.1f} ms]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minibatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    modules = (("serve", "minibatch.server"), ("bench", "minibatch.bench"),
               ("simulate", "minibatch.simulate"), ("profile", "minibatch.profile"), ("demo", "minibatch.demo"))
    for name, module in modules:
        p = sub.add_parser(name, help=f"see python -m minibatch {name} --help", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=None, module=module)

    argv = sys.argv[1:] if argv is None else list(argv)
    delegated = {name: module for name, module in modules}
    if argv and argv[0] in delegated:
        # Hand the rest over untouched: argparse's REMAINDER rejects a leading option (--port ...).
        args = argparse.Namespace(func=None, command=argv[0], module=delegated[argv[0]], rest=argv[1:])
    else:
        args = parser.parse_args(argv)
    if args.func is None:
        import importlib
        try:
            mod = importlib.import_module(args.module)
        except ModuleNotFoundError as e:
            if e.name == args.module:
                parser.error(f"'{args.command}' is not available in this build")
            raise
        return mod.main(args.rest)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
