"""Decode step time against batch size: minibatch vs llama.cpp's ``llama-batched-bench``,
and minibatch's OpenMP waiting set-ups alone and with a second engine on the same cores.

A decode step here: ``B`` sequences of ``--prompt-len`` prompt tokens each generate one
token. minibatch's figure is the wall time of one ``engine.step()`` call in a step where
all ``B`` sequences decode (scheduling, input preparation, forward, greedy sampling,
bookkeeping; the executor's share is printed beside it, and, for the fused decode's helper
thread, the share of measured steps it joined, the work items it ran in each, and its
backoffs, so a slow run shows whether the helper sat out). llama.cpp's is
``llama-batched-bench``'s text-generation time ``T_TG`` over its ``TG`` steps (``llama_decode``
of ``B`` tokens; no sampling), for ``-npp PROMPT -ntg TG -npl B``.

Each minibatch set-up (``--configs``) runs in a process of its own that stays up for the
whole run and is stopped (SIGSTOP) while another is measured; rounds alternate the order.
``--loaded`` adds, per set-up, a run with two such engines decoding at once (the README's
"two engines sharing 2 cores" case). Set-ups:

  default        minibatch as a user gets it (``import minibatch`` first: its OpenMP default)
  passive        OMP_WAIT_POLICY=PASSIVE      (threads sleep at once after a parallel region)
  active         OMP_WAIT_POLICY=ACTIVE       (threads spin until the next one, ~forever)
  spin=N         GOMP_SPINCOUNT=N             (spin N rounds of ``pause``, then sleep; libgomp's
                                              default without a wait policy is 300000)
  threads=N      torch.set_num_threads(N)     (and so the C kernels' OpenMP teams)
  rows=N         MINIBATCH_ONE_THREAD_TOKENS=N (steps of at most N tokens on one thread;
                                              rows=0: every step on torch's thread count)
  joined with +  e.g. ``passive+threads=1``

    python benchmarks/decode_sweep.py                                  # batches 1,8,32,128
    python benchmarks/decode_sweep.py --batches 1,8 --configs default,active,spin=20000 --loaded
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))


# -- the child: one minibatch engine ------------------------------------------------------------
def child(config: str, out_fd: int) -> int:
    import minibatch  # noqa: F401  (first: the package's OpenMP default applies when none is set)
    import numpy as np
    import torch

    from minibatch import LLM, SamplingParams
    from minibatch.kernels import cpu_paged

    for part in filter(None, config.split("+")):
        if part.startswith("threads="):
            torch.set_num_threads(int(part.split("=")[1]))
    llm = LLM("tiny")
    engine = llm.engine
    engine.executor.warm_up()
    vocab = engine.executor.model_config.vocab_size
    rng = np.random.default_rng(0)
    out = os.fdopen(out_fd, "w", buffering=1)
    from minibatch.kernels.cpu_threads import ONE_THREAD_TOKENS

    out.write(json.dumps({"ready": True, "threads": torch.get_num_threads(), "one_thread_tokens": ONE_THREAD_TOKENS,
                          "omp": os.environ.get("OMP_WAIT_POLICY"),
                          "spin": os.environ.get("GOMP_SPINCOUNT")}) + "\n")

    def measure(batch: int, prompt_len: int, seconds: float, max_steps: int) -> dict:
        walls, execs = [], []
        c0 = cpu_paged.decode_helper_counters()
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and len(walls) < max_steps:
            for _ in range(batch):
                engine.add_request(rng.integers(10, vocab - 10, size=prompt_len).tolist(),
                                   SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t
                s = engine.steps[-1]
                if s.num_decode_seqs == batch == s.num_seqs:
                    walls.append(dt)
                    execs.append(s.duration)
        engine.steps.clear()
        c1 = cpu_paged.decode_helper_counters()
        helped = c1["decode_helper_steps"] - c0["decode_helper_steps"]
        return {"n": len(walls), "wall_ms": 1e3 * statistics.median(walls),
                "exec_ms": 1e3 * statistics.median(execs),
                # The fused decode's helper thread in this measurement: the share of measured
                # steps it joined, work items per step it joined, and long waits (backoffs).
                "helper_pct": 100.0 * min(helped, len(walls)) / max(len(walls), 1),
                "helper_items": (c1["decode_helper_items"] - c0["decode_helper_items"]) / max(helped, 1),
                "backoffs": c1["decode_backoffs"] - c0["decode_backoffs"]}

    measure(1, 8, 0.2, 50)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        out.write(json.dumps(measure(cmd["batch"], cmd["prompt_len"], cmd["seconds"], cmd["max_steps"])) + "\n")
    return 0


# -- the parent ---------------------------------------------------------------------------------
def config_env(config: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MINIBATCH_ONE_THREAD_TOKENS"):
        env.pop(k, None)
    for part in filter(None, config.split("+")):
        if part == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif part == "active":
            env["OMP_WAIT_POLICY"] = "ACTIVE"
        elif part.startswith("spin="):
            env["GOMP_SPINCOUNT"] = part.split("=")[1]
        elif part.startswith("rows="):
            env["MINIBATCH_ONE_THREAD_TOKENS"] = part.split("=")[1]
        elif part.startswith("threads=") or part == "default":
            pass
        else:
            raise ValueError(f"unknown set-up part {part!r}")
    return env


class Engine:
    """A paused child engine process (see :func:`child`)."""

    def __init__(self, config: str, log: Path):
        r, w = os.pipe()
        self.config = config
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", config, "--out-fd", str(w)],
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=config_env(config), pass_fds=(w,), start_new_session=True)
        os.close(w)
        self.out = os.fdopen(r)
        line = self.out.readline()
        if not line:
            raise RuntimeError(f"{config}: child exited; see {log}")
        self.info = json.loads(line)
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def send(self, cmd: dict) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self) -> dict:
        ans = json.loads(self.out.readline())
        os.killpg(self.proc.pid, signal.SIGSTOP)
        return ans

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


def llama_batched(bench: Path, gguf: Path, batches, prompt_len: int, tg: int, threads: int | None,
                  concurrent: int = 1) -> list[dict]:
    """``llama-batched-bench`` (``concurrent`` copies at once); one row per batch size."""
    ctx = max(batches) * (prompt_len + tg) + 64
    # The first configuration runs twice and its first run is dropped (a warm-up: the first
    # llama_decode calls of a process were several times slower here).
    cmd = [str(bench), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
           "-ntg", str(tg), "-npl", ",".join(map(str, [batches[0], *batches])), "--output-format", "jsonl"]
    if threads:
        cmd += ["-t", str(threads)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(concurrent)]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("{")][1:]
        for line in lines:
            if line.startswith("{"):
                d = json.loads(line)
                rows.append({"batch": d["pl"], "step_ms": 1e3 * d["t_tg"] / d["tg"], "pp_ms": 1e3 * d["t_pp"],
                             "threads": d["n_threads"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--configs", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=1.5, help="measuring time per engine, batch and round")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--loaded", action="store_true", help="also two engines of each set-up at once")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-threads", type=int, default=None, help="llama.cpp -t (default: its own)")
    ap.add_argument("--nice", type=int, default=None,
                    help="run the measured engines at this nice value (e.g. -15 on a machine busy with "
                         "other work, to approximate an idle one; needs root)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.out_fd)

    import locate
    from workers import load_average

    if args.nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)      # inherited by the engines and llama.cpp
    batches = [int(b) for b in args.batches.split(",")]
    configs = args.configs.split(",")
    log = Path(args.log_dir)
    print(f"decode step, prompt {args.prompt_len} tokens; {args.rounds} rounds; load average {load_average()}",
          flush=True)
    engines = {c: Engine(c, log / f"decode_sweep_{re.sub('[^a-z0-9=]+', '_', c)}.log") for c in configs}
    twins = {c: Engine(c, log / f"decode_sweep_{re.sub('[^a-z0-9=]+', '_', c)}_twin.log")
             for c in configs} if args.loaded else {}
    for c, e in engines.items():
        print(f"  {c}: threads {e.info['threads']}, one thread up to {e.info['one_thread_tokens']} tokens, "
              f"OMP_WAIT_POLICY {e.info['omp']}, GOMP_SPINCOUNT {e.info['spin']}", flush=True)
    bench, gguf = locate.llama_bin("llama-batched-bench"), locate.tiny_gguf()
    use_llama = not args.no_llama and bench is not None and gguf is not None
    if not args.no_llama and not use_llama:
        print("  llama.cpp skipped: " + (locate.missing("llama.cpp") or "no llama-batched-bench"), flush=True)
    res: dict = {}          # (name, mode, batch) -> [per-round medians]
    loads = [load_average()]
    cmd = {"prompt_len": args.prompt_len, "seconds": args.seconds, "max_steps": args.max_steps}
    try:
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for b in batches:
                for c in order:
                    engines[c].send({**cmd, "batch": b})
                    a = engines[c].receive()
                    res.setdefault((c, "alone", b), []).append(a)
                    if args.loaded:
                        engines[c].send({**cmd, "batch": b})
                        twins[c].send({**cmd, "batch": b})
                        a, t = engines[c].receive(), twins[c].receive()
                        res.setdefault((c, "loaded", b), []).append(a)
                        res.setdefault((c, "loaded", b), []).append(t)
            if use_llama:
                tg = 32
                for row in llama_batched(bench, gguf, batches, args.prompt_len, tg, args.llama_threads):
                    res.setdefault(("llama.cpp", "alone", row["batch"]), []).append(
                        {"wall_ms": row["step_ms"], "exec_ms": row["step_ms"], "n": tg})
                if args.loaded:
                    for row in llama_batched(bench, gguf, batches, args.prompt_len, tg, args.llama_threads, 2):
                        res.setdefault(("llama.cpp", "loaded", row["batch"]), []).append(
                            {"wall_ms": row["step_ms"], "exec_ms": row["step_ms"], "n": tg})
            loads.append(load_average())
            print(f"  round {r + 1}/{args.rounds} done (load average {loads[-1]})", flush=True)
    finally:
        for e in [*engines.values(), *twins.values()]:
            e.stop()
    print(f"\n{'engine / set-up':28s} {'mode':7s} {'batch':>5s} {'step ms (median)':>16s} {'min-max':>13s} "
          f"{'exec ms':>8s} {'tok/s':>8s} {'helper %':>8s} {'items':>6s} {'backoffs':>8s}")
    table = []
    for (name, mode, b), vals in sorted(res.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        w = [v["wall_ms"] for v in vals]
        e = [v["exec_ms"] for v in vals]
        row = {"engine": name, "mode": mode, "batch": b, "step_ms": statistics.median(w), "min": min(w),
               "max": max(w), "exec_ms": statistics.median(e), "runs": w}
        # minibatch only: median share of steps with the helper, its items a step, total backoffs
        helper = (f"{statistics.median(v['helper_pct'] for v in vals):8.0f} "
                  f"{statistics.median(v['helper_items'] for v in vals):6.0f} {sum(v['backoffs'] for v in vals):8d}"
                  if "helper_pct" in vals[0] else f"{'-':>8s} {'-':>6s} {'-':>8s}")
        row.update({k: [v[k] for v in vals] for k in ("helper_pct", "helper_items", "backoffs") if k in vals[0]})
        table.append(row)
        print(f"{name:28s} {mode:7s} {b:5d} {row['step_ms']:16.3f} {row['min']:6.2f}-{row['max']:<6.2f} "
              f"{row['exec_ms']:8.3f} {1e3 * b / row['step_ms']:8.0f} {helper}", flush=True)
    print(f"load average per round: {loads}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": table, "load_average": loads, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
