"""Speculative decoding inside the batch: where prompt lookup pays and where it stops paying.

tiny  The embedded tiny model, really run on this CPU: ``--batches`` (1, 4, 16, 64) greedy
      requests started together (a closed batch: all prompts at once, ``max_num_seqs`` = the
      batch), 64 output tokens each, two workloads: ``repetitive`` (each prompt a random
      snippet of 12-24 tokens repeated 4 times, code/echo style, where prompt lookup finds
      drafts) and ``random`` (random tokens, nothing to look up in the prompt). Speculation:
      ``speculative_method="ngram"``, ``num_speculative_tokens`` ``--k`` (4),
      ``prompt_lookup_min`` 1, ``prompt_lookup_max`` 3. Throughput = output tokens / wall time
      of the whole generate; ``--rounds`` (3) rounds alternate off/on, the ratio on/off is the
      median of the per-round ratios; every round checks that the tokens are equal. Also the
      acceptance rate (accepted / draft tokens, vLLM's counters) and the tokens per sequence
      and verify step.
sim   Llama-3.1-8B on one H100 (roofline cost model): the closed-form speed-up of ``k`` = 3
      drafts at acceptance 0.6 and 0.8, for batch sizes 1..1024 and contexts 256 / 1024 /
      4096 (``minibatch.sim.spec_decode.spec_step_speedup``), the best ``k`` per batch size,
      and the same effect from engine runs of the simulator (SimExecutor, virtual clock):
      B requests of 256-token prompts and 256 outputs, throughput on/off per batch size, for
      k = 3 and for a ``num_speculative_tokens_per_batch_size`` table built from the best k.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode.py              # both (~3 min here, loaded)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode.py --skip-tiny
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minibatch import LLM, LLMEngine, EngineConfig, SamplingParams
from minibatch.sim import make_cost_model
from minibatch.sim.spec_decode import best_draft_length, spec_step_speedup

SPEC = dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)


def prompts(kind: str, n: int, seed: int) -> list[list[int]]:
    """``repetitive``: a random snippet repeated 4 times; ``random``: 64 random tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "repetitive":
            snippet = [rng.randrange(3, 2000) for _ in range(rng.randint(12, 24))]
            out.append(snippet * 4)
        else:
            out.append([rng.randrange(3, 2000) for _ in range(64)])
    return out


def tiny_round(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, list, dict]:
    before = llm.engine.spec_decode_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    dt = time.perf_counter() - t0
    after = llm.engine.spec_decode_metrics()
    delta = {k: after[k] - before[k] for k in after}
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / dt, tokens, delta


def tiny(args) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for kind in ("repetitive", "random"):
        for b in args.batches:
            off = LLM("tiny", max_num_seqs=b)
            on = LLM("tiny", max_num_seqs=b, num_speculative_tokens=args.k, **SPEC)
            warm = prompts(kind, min(b, 4), seed=999)
            off.generate(warm, params), on.generate(warm, params)
            ratios, acc, per_step, tps_on, tps_off = [], [], [], [], []
            for r in range(args.rounds):
                batch = prompts(kind, b, seed=r)
                first, second = (off, on) if r % 2 == 0 else (on, off)
                res = {id(first): tiny_round(first, batch, params), id(second): tiny_round(second, batch, params)}
                (t_off, tok_off, _), (t_on, tok_on, m) = res[id(off)], res[id(on)]
                assert tok_on == tok_off, f"greedy tokens differ with speculation ({kind}, batch {b})"
                ratios.append(t_on / t_off)
                tps_on.append(t_on)
                tps_off.append(t_off)
                drafted = m["vllm:spec_decode_num_draft_tokens"]
                acc.append(m["vllm:spec_decode_num_accepted_tokens"] / drafted if drafted else 0.0)
                drafts = m["vllm:spec_decode_num_drafts"]
                per_step.append(1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else 1.0)
            row = {"workload": kind, "batch": b, "tok_s_off": statistics.median(tps_off),
                   "tok_s_on": statistics.median(tps_on), "ratio": statistics.median(ratios),
                   "acceptance": statistics.median(acc), "tokens_per_verify": statistics.median(per_step)}
            rows.append(row)
            print(f"tiny  {kind:10s} batch {b:3d}: {row['tok_s_off']:7.0f} -> {row['tok_s_on']:7.0f} tok/s, "
                  f"on/off {row['ratio']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
                  f"acceptance {row['acceptance']:.2f}, {row['tokens_per_verify']:.2f} tokens per verify")
    return rows


def sim_engine_ratio(batch: int, k: int, acceptance: float, prompt_len: int = 256, max_tokens: int = 256,
                     per_batch_size=None) -> dict:
    """Output tokens per second of virtual time, speculation on / off, for ``batch`` requests
    started together on the simulator (Llama-3.1-8B, H100)."""
    out = {}
    for on in (False, True):
        kw = dict(model="llama-3.1-8b", executor="sim", hardware="h100", max_num_seqs=max(batch, 1),
                  max_num_batched_tokens=max(8192, batch * (1 + k)))
        if on:
            kw.update(speculative_method="ngram", num_speculative_tokens=k, spec_acceptance_rate=acceptance,
                      num_speculative_tokens_per_batch_size=per_batch_size)
        engine = LLMEngine(EngineConfig.from_kwargs(**kw), clock="virtual")
        for i in range(batch):
            engine.add_request([3 + i % 1000] * prompt_len,
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        out[on] = batch * max_tokens / engine.clock.now()
    return {"tok_s_off": out[False], "tok_s_on": out[True], "ratio": out[True] / out[False]}


def sim(args) -> dict:
    cm = make_cost_model("llama-3.1-8b", "h100")
    curve = {}
    for ctx in (256, 1024, 4096):
        for a in (0.6, 0.8):
            pts = [(b, spec_step_speedup(cm, b, ctx, 3, a)["speedup"]) for b in args.sim_batches]
            curve[(ctx, a)] = pts
            best = [best_draft_length(cm, b, ctx, a) for b in args.sim_batches]
            print(f"sim   ctx {ctx:5d} acceptance {a}: k=3 speed-up " +
                  ", ".join(f"B={b}: {s:.2f}x" for b, s in pts) + f"; best k {best}")
    # The draft length by batch size (vLLM's num_speculative_tokens_per_batch_size) from the cost model's best k.
    best = {b: best_draft_length(cm, b, 256, 0.6, max_k=6) for b in args.sim_batches}
    schedule, lo = [], 1
    for b in sorted(best):
        if schedule and schedule[-1][2] == best[b]:
            schedule[-1][1] = b
        else:
            schedule.append([lo, b, best[b]])
        lo = b + 1
    print(f"sim   num_speculative_tokens_per_batch_size = {schedule}")
    engine_rows = []
    for b in args.sim_engine_batches:
        r = sim_engine_ratio(b, 3, 0.6)
        d = sim_engine_ratio(b, max(best.values()), 0.6, per_batch_size=schedule)
        engine_rows.append((b, r, d))
        print(f"sim   engine B={b:4d} acceptance 0.6: off {r['tok_s_off']:8.0f} tok/s; k=3 {r['tok_s_on']:8.0f} "
              f"(on/off {r['ratio']:.2f}x); schedule {d['tok_s_on']:8.0f} (on/off {d['ratio']:.2f}x)")
    return {"curve": curve, "engine": engine_rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sim-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--sim-engine-batches", type=int, nargs="+", default=[1, 32, 128, 512])
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_tiny:
        tiny(args)
    if not args.skip_sim:
        sim(args)


if __name__ == "__main__":
    main()
