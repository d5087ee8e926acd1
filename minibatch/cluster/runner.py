"""``minibatch.cluster.run``: N replicas behind a router, one discrete-event loop, one virtual time.

Every replica is a real :class:`~minibatch.engine.LLMEngine` (its own scheduler, KV pool
and :class:`~minibatch.clock.VirtualClock`) built from the same ``EngineConfig`` fields.
The loop has two kinds of events:

* an **arrival** at its arrival time: the router picks a replica among those serving the
  request's model (it sees :class:`~minibatch.cluster.ReplicaView` s as of that time) and
  the request joins that engine's queue;
* a replica's **next step**, at the time its clock reads (when its last step ended). A step
  that starts at ``t`` and lasts ``d`` (measured for the real model, modelled by the
  simulator) moves that replica's clock to ``t + d`` and no other.

The loop always handles the earliest event, an arrival first on a tie (as ``minibatch.run``
admits the arrivals due before it steps), so a request routed at ``t`` never sees a replica
step that starts after ``t``, and N replicas behave as N machines side by side though their
steps run one after another in this process. With one replica the loop does exactly what
``minibatch.run`` does: the same records, times and steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minibatch.cluster import routers as _routers
from minibatch.cluster.replica import Replica
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.results import RequestRecord, RunResult, summarize
from minibatch.runner import _prepare_workload
from minibatch.sampling_params import SamplingParams

_EPS = 1e-12   # minibatch.run's tolerance: an arrival due within it of a step's start joins that step


@dataclass
class ClusterResult:
    """What :func:`run` returns: every request's record, one ``RunResult`` per replica."""

    requests: list[RequestRecord]        # every request, arrival order, each with .replica
    replicas: list[RunResult]            # per replica: its requests and its step timeline
    router: str
    models: list[str]                    # the model of each replica
    wall_time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def steps(self):
        """All replicas' steps (each replica's ``StepRecord.step`` counts its own)."""
        return [s for r in self.replicas for s in r.steps]

    def summary(self, slo: dict[str, float] | None = None, trim: float = 0.0) -> dict:
        """``RunResult.summary()``'s keys over all requests and all replicas' steps, plus:

        ``replicas`` (how many), ``routed`` (requests routed to each replica; a request no
        replica serves counts in none), ``replica_seconds`` (replicas x the run's span, first
        arrival to the last step's end: what N provisioned machines cost), ``busy_replica_seconds``
        (time the replicas spent in steps), and ``migrations``, ``kv_transfer_bytes`` and
        ``scale_events``, which stay 0 / 0 / [] here: these runs have no migration, no
        disaggregation and no autoscaler.
        """
        out = summarize(self.requests, self.steps, slo, trim)
        out["replicas"] = len(self.replicas)
        out["routed"] = [len(r.requests) for r in self.replicas]
        starts = [r.arrival_time for r in self.requests]
        ends = [s.start_time + s.duration for s in self.steps] + \
               [r.finish_time for r in self.requests if r.finish_time is not None]
        span = (max(ends) - min(starts)) if starts and ends else 0.0
        out["replica_seconds"] = len(self.replicas) * span
        out["busy_replica_seconds"] = float(sum(s.duration for s in self.steps))
        out["migrations"] = 0
        out["kv_transfer_bytes"] = 0
        out["scale_events"] = []
        return out


def _replica_models(replicas: int, model, models) -> list[str]:
    if models is None:
        return [model] * replicas
    if isinstance(models, dict):
        out = [name for name, count in models.items() for _ in range(int(count))]
    else:
        out = list(models)
    if not out:
        raise ValueError("models= names no replica")
    if replicas is not None and replicas != len(out) and replicas != 1:
        raise ValueError(f"replicas={replicas} but models= names {len(out)} replicas: {out}")
    return out


def run(workload, replicas: int = 1, router="round_robin", executor: str = "sim", model: str = "tiny",
        hardware: str | None = None, *, models=None, router_kwargs: dict | None = None,
        engines: list[LLMEngine] | None = None, keep_tokens: bool | None = None,
        on_step: Callable | None = None, clock: str = "virtual", **engine_kwargs) -> ClusterResult:
    """Replay ``workload`` on ``replicas`` engines behind ``router``; return a :class:`ClusterResult`.

    ``router`` is a registered name (``minibatch.cluster.routers.available()``), a
    ``Router`` class or instance; ``router_kwargs`` go to its constructor. Every replica
    gets ``EngineConfig.from_kwargs(executor=..., model=..., hardware=..., **engine_kwargs)``.
    ``models`` makes replicas serve different models: a list (one model per replica) or a
    mapping ``{model: number of replicas}``; a request whose ``RequestSpec.model`` is set goes
    to a replica serving that model, and is rejected (with the reason in its record) if none
    does. ``engines`` hands in ready-made engines instead (each with its own virtual clock;
    their ``config.model`` names what they serve). ``on_step(replica_index, engine, step)`` is
    called after every step that ran. ``clock`` must be ``"virtual"``: the replicas' time is
    the event loop's (a wall-clock cluster is the HTTP router's job).
    """
    if clock != "virtual":
        raise ValueError(f"minibatch.cluster.run replays under the virtual clock only, got clock={clock!r}")
    wall0 = time.perf_counter()
    if engines is None:
        names = _replica_models(replicas, model, models)
        engines = []
        for name in names:
            cfg = EngineConfig.from_kwargs(executor=executor, model=name, hardware=hardware, **engine_kwargs)
            engines.append(LLMEngine(cfg, clock="virtual"))
    else:
        names = [e.config.model for e in engines] if models is None else _replica_models(len(engines), model, models)
    if not engines:
        raise ValueError("a cluster needs at least one replica")
    reps = [Replica(i, e, names[i]) for i, e in enumerate(engines)]
    rt = _routers.get(router, **(router_kwargs or {}))
    by_model: dict[str, list[Replica]] = {}
    for r in reps:
        by_model.setdefault(r.model, []).append(r)

    # Token ids, once for the whole cluster, as minibatch.run makes them (from the engine with
    # the smallest vocabulary, so that they are valid for every replica's model).
    ref = min(engines, key=lambda e: (e.vocab_size is None, e.vocab_size or 0))
    specs = _prepare_workload(workload, ref, ref.config.seed)
    if rt.uses_prompt_tokens and any(s.prompt_token_ids is None for s in specs):
        from minibatch.workload import Workload
        specs = list(Workload(specs).materialize(ref.vocab_size or 32000, seed=ref.config.seed))
    specs = sorted(specs, key=lambda s: s.arrival_time)
    if keep_tokens is None:
        keep_tokens = any(e.config.executor == "model" for e in engines)

    order: list[tuple[str, Replica | None]] = []     # every request, arrival order
    unserved: dict[str, RequestRecord] = {}

    def route(spec, now: float) -> None:
        rid = spec.request_id if spec.request_id is not None else f"r{len(order)}"
        candidates = reps if spec.model is None else by_model.get(spec.model, [])
        if not candidates:
            served = sorted(by_model)
            unserved[rid] = RequestRecord(
                rid, now, spec.prompt_len, 0, spec.priority, spec.tenant, finish_time=now,
                finish_reason="rejected", model=spec.model,
                error=f"no replica serves model {spec.model!r}; the cluster serves {served}")
            order.append((rid, None))
            return
        prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else [0] * spec.prompt_len
        views = [r.view(now, spec.prompt_token_ids) for r in candidates]
        pos = rt.choose(spec, views, now)
        if not isinstance(pos, int) or not 0 <= pos < len(candidates):
            raise ValueError(f"router {rt.name!r} chose {pos!r}; expected a position in 0..{len(candidates) - 1}")
        rep = candidates[pos]
        engine = rep.engine
        engine.clock.advance_to(now)       # an idle machine waits for the request; a busy one is past it
        params = SamplingParams(temperature=0.0, max_tokens=max(1, spec.max_tokens), ignore_eos=True)
        queued = True
        try:
            engine.add_request(prompt, params, request_id=rid, arrival_time=now,
                               priority=spec.priority, tenant=spec.tenant)
        except ValueError as e:
            engine.requests[rid] = engine.reject(prompt, params, str(e), request_id=rid, arrival_time=now)
            queued = False
        rep.admitted(rid, len(prompt), now, queued)
        order.append((rid, rep))

    pending = deque(specs)
    while True:
        nxt = min(reps, key=lambda r: r.next_event_time())
        t_rep = nxt.next_event_time()
        if pending and pending[0].arrival_time <= t_rep + _EPS:
            spec = pending.popleft()
            route(spec, spec.arrival_time)
            continue
        if t_rep == float("inf"):
            stuck = [r for r in reps if r.engine.has_unfinished_requests()]
            if stuck:
                r = stuck[0]
                raise RuntimeError(f"replica {r.index} made no progress and nothing is due: policy "
                                   f"{r.engine.scheduler.policy.name!r} holds {r.engine.num_waiting} "
                                   "waiting requests forever")
            break
        step = nxt.step()
        if step is not None and on_step is not None:
            on_step(nxt.index, nxt.engine, step)

    records: list[RequestRecord] = []
    per_replica: list[list[RequestRecord]] = [[] for _ in reps]
    for i, (rid, rep) in enumerate(order):
        if rep is None:
            rec = unserved[rid]
        else:
            rec = RequestRecord.of(rep.engine.requests[rid], keep_tokens=keep_tokens)
            rec.replica = rep.index
            rec.model = specs[i].model
            per_replica[rep.index].append(rec)
        records.append(rec)
    wall = time.perf_counter() - wall0
    results = [RunResult(per_replica[r.index], list(r.engine.steps), r.engine.config.to_dict(), [],
                         r.engine.kv.num_blocks, wall, extra={"model": r.model}) for r in reps]
    return ClusterResult(records, results, rt.name, [r.model for r in reps], wall)
