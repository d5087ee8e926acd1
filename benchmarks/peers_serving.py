"""One client against three servers: minibatch, vLLM's CPU build and llama.cpp's llama-server.

Every server serves the embedded ``tiny`` model (llama.cpp: its f32 GGUF conversion) on
127.0.0.1; each runs in a session of its own and is stopped (SIGSTOP) while another is
measured, so an idle server's polling takes no CPU from the one under test (vLLM's engine
core busy-loops when idle). The same requests (random token-id prompts, ``--input-len`` in,
``--output-len`` out, ``ignore_eos``, greedy, streamed) go to each through the same client,
``minibatch.bench`` (the metric definitions of ``vllm bench serve``), at each point of
``--concurrency`` (requests in flight at once, sent as fast as allowed) and ``--rates``
(Poisson arrivals, requests/s). ``--rounds`` rounds; the servers' order alternates round by
round; the tables give the median of the rounds and the min-max of output tokens/s.

Then, if it runs, ``vllm bench serve`` (vLLM's own client, through ``peers/vllm_cpu.py``)
against each server at one point, as a cross-check of the client.

Each peer is skipped with a message when it is not installed (``benchmarks/peers/setup_*.sh``,
``$MINIBATCH_PEERS``).

    python benchmarks/peers_serving.py                           # concurrency 1,32,128; rates 8,32
    python benchmarks/peers_serving.py --servers minibatch,llama.cpp --concurrency 32 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(ROOT / "tests"))

import locate  # noqa: E402
from serving_utils import free_port  # noqa: E402
from workers import load_average  # noqa: E402

from minibatch.bench import run_benchmark  # noqa: E402
from minibatch.bench.datasets import make_requests  # noqa: E402

START_TIMEOUT_S = 1800
KV_BYTES = 256 << 20          # minibatch's default KV budget on the CPU, given to vLLM too


class Server:
    """A server process in its own session; paused between its measurements."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, health: str = "/health"):
        self.name, self.port = name, None
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = cmd[cmd.index("--port") + 1] if "--port" in cmd else None
        self.url = f"http://127.0.0.1:{self.url}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}); log {log}:\n{self.tail()}")
            try:
                if httpx.get(self.url + health, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} not ready in {START_TIMEOUT_S} s; log {log}")
            time.sleep(1.0)
        self.pause()

    def tail(self) -> str:
        self._log.flush()
        return Path(self.log_path).read_text(errors="replace")[-3000:]

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def start_servers(names: list[str], max_conc: int, ctx_per_seq: int, log_dir: Path,
                  vllm_settings: str) -> dict[str, Server]:
    from minibatch.model.loader import resolve_model_path

    tiny = str(resolve_model_path("tiny"))
    servers = {}
    for name in names:
        port = str(free_port())
        if name == "minibatch":
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
            env.pop("OMP_WAIT_POLICY", None)            # minibatch's own default
            cmd = [sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--port", port,
                   "--uvicorn-log-level", "warning", "--served-model-name", "tiny"]
        elif name == "vllm":
            why = locate.missing("vllm")
            if why:
                print(f"  {why}", flush=True)
                continue
            env = locate.vllm_env(vllm_settings)
            cmd = [str(locate.vllm_python()), str(locate.VLLM_WRAPPER), "serve", tiny, "--port", port,
                   "--host", "127.0.0.1", "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_BYTES),
                   "--served-model-name", "tiny", "--seed", "0", "--disable-uvicorn-access-log",
                   "--disable-log-stats"]
        elif name == "llama.cpp":
            why = locate.missing("llama.cpp")
            if why:
                print(f"  {why}", flush=True)
                continue
            env = dict(os.environ)
            # One slot per concurrent request; each slot holds prompt + output.
            cmd = [str(locate.llama_bin("llama-server")), "-m", str(locate.tiny_gguf()), "--host", "127.0.0.1",
                   "--port", port, "-np", str(max_conc), "-c", str(max_conc * ctx_per_seq),
                   "--alias", "tiny", "--no-webui"]
        else:
            raise ValueError(name)
        t = time.perf_counter()
        try:
            servers[name] = Server(name, cmd, env, log_dir / f"peers_serving_{name}.log")
        except RuntimeError as e:
            print(f"  {name} did not start: {e}", flush=True)
            continue
        print(f"  {name} up on {servers[name].url} in {time.perf_counter() - t:.0f} s", flush=True)
    return servers


def check_llama_tokenizer(server: Server, texts: list[str]) -> str:
    """llama-server's /tokenize of a few texts against the HF tokenizer's ids (the GGUF's
    pre-tokenizer was recorded as 'gpt-2'; the benchmarks send ids, so this is a note)."""
    from minibatch.model.loader import resolve_model_path
    from minibatch.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("tiny"))
    same = 0
    for t in texts:
        r = httpx.post(server.url + "/tokenize", json={"content": t, "add_special": False}, timeout=30)
        same += r.json().get("tokens") == tok.encode(t, add_special_tokens=False)
    return f"{same}/{len(texts)}"


WARMUP_SEED = 999_999   # the warm-up's prompts: none of the measured ones
POINTS_HEADER = (f"{'point':>14s} {'server':10s} {'out tok/s':>9s} {'min-max':>13s} {'req/s':>6s} "
                 f"{'TTFT p50':>8s} {'TTFT p99':>8s} {'TPOT p50':>8s} {'E2E p50':>8s} {'fail':>4s}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="minibatch,vllm,llama.cpp")
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--rates", default="8,32", help="Poisson request rates (req/s); empty for none")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=128, help="requests per point (concurrency 1: 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-settings", default=locate.VLLM_BEST)
    ap.add_argument("--no-vllm-bench", action="store_true", help="skip the `vllm bench serve` cross-check")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.servers.split(",")
    concs = [int(c) for c in args.concurrency.split(",") if c]
    rates = [float(r) for r in args.rates.split(",") if r]
    log_dir = Path(args.log_dir)
    print(f"== serving: {args.input_len} in / {args.output_len} out, greedy, ignore_eos, streamed; "
          f"{args.rounds} rounds; load average {load_average()}", flush=True)
    servers = start_servers(names, max(concs + [32]), args.input_len + args.output_len + 16, log_dir,
                            args.vllm_settings)
    results: dict = {"load_average": [load_average()], "points": {}}
    try:
        if "llama.cpp" in servers:
            s = servers["llama.cpp"]
            s.resume()
            texts = ["小明和他的狗", "Hello, world!", "The cat sat on the mat.", "一二三 abc 123"]
            try:
                results["llama_tokenizer_match"] = check_llama_tokenizer(s, texts)
                print(f"  llama.cpp /tokenize equals the HF tokenizer on {results['llama_tokenizer_match']} "
                      "texts (the benchmarks send token ids)", flush=True)
            except Exception as e:  # a note, not the benchmark
                print(f"  llama.cpp /tokenize check failed: {type(e).__name__}: {e}", flush=True)
            s.pause()
        points = [("conc", c) for c in concs] + [("rate", r) for r in rates]
        for name, s in servers.items():          # warm-up: first requests, first shapes
            s.resume()
            run_benchmark(base_url=s.url, model="tiny", tokenizer="tiny", num_prompts=8, seed=WARMUP_SEED,
                          random_input_len=args.input_len, random_output_len=8, max_concurrency=8)
            s.pause()
        order = list(servers)
        for r in range(args.rounds):
            for pi, (kind, v) in enumerate(points):
                n = 16 if (kind == "conc" and v == 1) else args.num_prompts
                # Prompts never repeat (seed per round and point, none the warm-up's): vLLM
                # (enable_prefix_caching=True, vllm/config/cache.py v0.32.0) and llama-server
                # (--cache-prompt on) would skip the prefill of a repeated prompt, minibatch
                # (prefix caching off by default) would not.
                reqs = make_requests("random", n, "tiny", input_len=args.input_len, output_len=args.output_len,
                                     request_rate=v if kind == "rate" else None, seed=1000 * (r + 1) + pi)
                for name in (order if r % 2 == 0 else order[::-1]):
                    s = servers[name]
                    s.resume()
                    try:
                        # A new connection per request for every server (the same client for
                        # all): llama-server closes a connection after a streamed response
                        # though it answers "Keep-Alive", and reusing it failed 45 of 384
                        # requests at concurrency 32.
                        res = run_benchmark(base_url=s.url, model="tiny", requests=reqs,
                                            max_concurrency=v if kind == "conc" else None,
                                            force_close=True)
                    finally:
                        s.pause()
                    key = f"{kind}={v:g}"
                    results["points"].setdefault(key, {}).setdefault(name, []).append(res)
                    if res["failed"]:
                        print(f"  {key} {name}: {res['failed']} failed: {[e for e in res.get('errors', []) if e][:2]}", flush=True)
            results["load_average"].append(load_average())
            print(f"  round {r + 1}/{args.rounds} done (load average {results['load_average'][-1]})", flush=True)
        print("\n" + POINTS_HEADER + "   (latencies in ms; medians of rounds)")
        summary = {}
        for key, per in results["points"].items():
            for name, runs in per.items():
                tok = [x["output_throughput"] for x in runs]

                def med(k, runs=runs):
                    return statistics.median(x[k] for x in runs)
                row = {"out_tok_s": statistics.median(tok), "min": min(tok), "max": max(tok),
                       "req_s": med("request_throughput"), "ttft_p50": med("median_ttft_ms"),
                       "ttft_p99": med("p99_ttft_ms"), "tpot_p50": med("median_tpot_ms"),
                       "e2el_p50": med("median_e2el_ms"), "failed": sum(x["failed"] for x in runs)}
                summary.setdefault(key, {})[name] = row
                print(f"{key:>14s} {name:10s} {row['out_tok_s']:9.1f} {row['min']:6.0f}-{row['max']:<6.0f} "
                      f"{row['req_s']:6.2f} {row['ttft_p50']:8.1f} {row['ttft_p99']:8.1f} {row['tpot_p50']:8.2f} "
                      f"{row['e2el_p50']:8.1f} {row['failed']:4d}", flush=True)
            if "minibatch" in per:
                ratios = ", ".join(f"minibatch/{n} {summary[key]['minibatch']['out_tok_s'] / summary[key][n]['out_tok_s']:.2f}x"
                                   for n in per if n != "minibatch")
                if ratios:
                    print(f"{'':>14s} {ratios}", flush=True)
        results["summary"] = summary
        if not args.no_vllm_bench and locate.missing("vllm") is None:
            results["vllm_bench"] = vllm_bench(servers, args, log_dir)
    finally:
        for s in servers.values():
            s.stop()
    results["load_average"].append(load_average())
    for x in results["points"].values():
        for runs in x.values():
            for run in runs:
                run.pop("errors", None)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


def vllm_bench(servers: dict, args, log_dir: Path, concurrency: int = 32, n: int = 128) -> dict:
    """``vllm bench serve`` (random dataset, the same lengths, ignore_eos) against each server."""
    from minibatch.model.loader import resolve_model_path

    tiny = str(resolve_model_path("tiny"))
    out = {}
    print(f"\n== vllm bench serve, {n} prompts, max concurrency {concurrency}", flush=True)
    for name, s in servers.items():
        result = log_dir / f"vllm_bench_{name}.json"
        cmd = [str(locate.vllm_python()), str(locate.VLLM_WRAPPER), "bench", "serve", "--backend", "openai",
               "--base-url", s.url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", tiny,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(n),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(log_dir), "--result-filename", result.name]
        s.resume()
        try:
            p = subprocess.run(cmd, env=locate.vllm_env("default"), capture_output=True, text=True, timeout=1800)
        finally:
            s.pause()
        if p.returncode != 0 or not result.exists():
            print(f"  {name}: vllm bench serve failed ({p.returncode}): {p.stderr[-600:]}", flush=True)
            continue
        d = json.loads(result.read_text())
        out[name] = {k: d.get(k) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
                                           "median_e2el_ms", "completed")}
        print(f"  {name:10s} out tok/s {d['output_throughput']:8.1f}  TTFT p50 {d['median_ttft_ms']:7.1f} ms  "
              f"TPOT p50 {d['median_tpot_ms']:6.2f} ms  completed {d['completed']}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main() or 0)
