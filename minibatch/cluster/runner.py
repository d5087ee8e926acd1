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

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minibatch.cluster import routers as _routers
from minibatch.cluster.replica import Replica
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.results import RequestRecord, RunResult, summarize
from minibatch.runner import _prepare_workload, with_fewer_gc_passes
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
        (time the replicas spent in steps), ``migrations`` (requests moved, see
        ``minibatch.cluster.migration``), ``kv_transfer_bytes`` (KV bytes those moves, or the
        prefill-to-decode transfers of a disaggregated cluster, copied), ``kv_transfers`` (those
        transfers, ``minibatch.cluster.disagg``) and
        ``scale_events`` (``(time, replicas)`` after each change of the autoscaler's target:
        replicas provisioned and not draining). With an autoscaler ``replica_seconds`` counts
        each replica from its start (its cold start included) to its removal (the end of its
        drain), or to the run's end.
        """
        out = summarize(self.requests, self.steps, slo, trim)
        out["replicas"] = len(self.replicas)
        out["routed"] = list(self.extra.get("routed", [len(r.requests) for r in self.replicas]))
        starts = [r.arrival_time for r in self.requests]
        ends = [s.start_time + s.duration for s in self.steps] + \
               [r.finish_time for r in self.requests if r.finish_time is not None]
        span = (max(ends) - min(starts)) if starts and ends else 0.0
        lifetimes = self.extra.get("lifetimes")
        if lifetimes is None:
            out["replica_seconds"] = len(self.replicas) * span
        else:
            # Autoscaled: each replica from its start (cold start included) to its removal,
            # or to the run's end if it was never removed.
            t_end = max([min(starts) + span] + [a for a, _ in lifetimes]) if starts else 0.0
            out["replica_seconds"] = float(sum((t_end if b is None else b) - a for a, b in lifetimes))
        out["busy_replica_seconds"] = float(sum(s.duration for s in self.steps))
        out["migrations"] = int(self.extra.get("migrations", 0))
        out["kv_transfer_bytes"] = int(self.extra.get("kv_transfer_bytes", 0))
        out["kv_transfers"] = int(self.extra.get("kv_transfers", 0))
        out["scale_events"] = list(self.extra.get("scale_events", []))
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


@with_fewer_gc_passes
def run(workload, replicas: int = 1, router="round_robin", executor: str = "sim", model: str = "tiny",
        hardware: str | None = None, *, models=None, router_kwargs: dict | None = None,
        engines: list[LLMEngine] | None = None, keep_tokens: bool | None = None,
        on_step: Callable | None = None, clock: str = "virtual", autoscaler=None,
        migration=None, disaggregation=None, failures=None, flow_control=None,
        **engine_kwargs) -> ClusterResult:
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

    ``autoscaler`` (a :class:`~minibatch.cluster.autoscaler.Autoscaler`) starts the cluster
    with its ``initial_replicas`` (else ``min_replicas``; ``replicas`` is then ignored) and,
    every ``interval_s`` of virtual time, adds replicas (serving after ``cold_start_s``) or
    drains them, with Ray Serve's rule; it needs one model and no ``engines=``.
    ``migration`` (``True`` or a :class:`~minibatch.cluster.migration.Migration`) moves running
    requests with their KV blocks from loaded to light replicas (Llumnix).
    ``disaggregation`` (a :class:`~minibatch.cluster.disagg.Disaggregation`) runs its ``prefill``
    replicas (indices ``0..P-1``, the router picks among them) and ``decode`` replicas (``P..``);
    a prefilled request's KV blocks go over the link to a decode replica
    (DistServe, ``minibatch.cluster.disagg``); ``replicas`` is then ignored and ``engines``, if
    given, are the P prefill engines followed by the D decode engines.
    ``failures`` (a list of :class:`~minibatch.cluster.failures.ReplicaFailure`) kills replicas
    mid-run; what a dead replica held is re-dispatched through the router to live ones
    (``minibatch.cluster.failures``).
    ``flow_control`` (a :class:`~minibatch.cluster.flow_control.FlowControl`) holds arrivals at
    the router, by priority band and fair across tenants, until a replica has room; the router
    then chooses among the replicas with room (llm-d's flow controller, Dynamo's router queue,
    ``minibatch.cluster.flow_control``); it goes with one model.
    """
    if clock != "virtual":
        raise ValueError(f"minibatch.cluster.run replays under the virtual clock only, got clock={clock!r}")
    wall0 = time.perf_counter()
    scaler = autoscaler
    if scaler is not None:
        if engines is not None or models is not None:
            raise ValueError("autoscaler= builds its replicas itself: pass model=, not engines= or models=")
        scaler.reset()
        replicas = scaler.start_replicas

    def make_engine(name: str, hw: str | None = None) -> LLMEngine:
        cfg = EngineConfig.from_kwargs(executor=executor, model=name, hardware=hw or hardware, **engine_kwargs)
        return LLMEngine(cfg, clock="virtual")

    dis = disaggregation
    if dis is not None:
        if scaler is not None or migration or models is not None:
            raise ValueError("disaggregation= goes with one model and neither autoscaler= nor migration=")
        replicas = dis.prefill + dis.decode
        if engines is not None and len(engines) != replicas:
            raise ValueError(f"disaggregation= needs {dis.prefill} prefill + {dis.decode} decode engines, "
                             f"got {len(engines)}")
    if engines is None:
        names = _replica_models(replicas, model, models)
        engines = []
        for i, name in enumerate(names):
            hw = None if dis is None else (dis.prefill_hardware if i < dis.prefill else dis.decode_hardware)
            engines.append(make_engine(name, hw))
    else:
        names = [e.config.model for e in engines] if models is None else _replica_models(len(engines), model, models)
    if not engines:
        raise ValueError("a cluster needs at least one replica")
    reps = [Replica(i, e, names[i]) for i, e in enumerate(engines)]
    pd = None
    if dis is not None:
        from minibatch.cluster.disagg import Disaggregator
        pd = Disaggregator(dis, reps[:dis.prefill], reps[dis.prefill:])
    rt = _routers.get(router, **(router_kwargs or {}))
    fo = None
    if failures:
        if dis is not None or migration:
            raise ValueError("failures= goes with neither migration= nor disaggregation=")
        from minibatch.cluster.failures import Failover
        fo = Failover(failures, len(reps))
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
    spec_of: dict = {}                   # request id -> its spec (a re-dispatch routes it again)
    if keep_tokens is None:
        keep_tokens = any(e.config.executor == "model" for e in engines)

    order: list[tuple[str, Replica | None]] = []     # every request, arrival order
    unserved: dict[str, RequestRecord] = {}

    def candidates_of(spec, now: float) -> list[Replica]:
        candidates = reps if spec.model is None else by_model.get(spec.model, [])
        if pd is not None:
            candidates = [r for r in candidates if r in pd.prefill]
        if scaler is not None or fo is not None:
            candidates = [r for r in candidates if r.serving(now)]
        return candidates

    def route(spec, now: float, rid: str | None = None, slot: int | None = None,
              among: list[Replica] | None = None) -> None:
        """Route ``spec`` at ``now`` among ``among`` (default: every replica serving it); a
        request held by flow control comes with its id and its ``slot`` in ``order``."""
        if rid is None:
            rid = spec.request_id if spec.request_id is not None else f"r{len(order)}"
        candidates = candidates_of(spec, now) if among is None else among
        if not candidates:
            served = sorted(by_model)
            unserved[rid] = RequestRecord(
                rid, now, spec.prompt_len, 0, spec.priority, spec.tenant, finish_time=now,
                finish_reason="rejected", model=spec.model,
                error=f"no replica serves model {spec.model!r}; the cluster serves {served}")
            if slot is None:
                order.append((rid, None))
            else:
                order[slot] = (rid, None)
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
            if pd is not None and not pd.can_ever_decode(len(prompt) + params.max_tokens):
                raise ValueError(f"request needs {len(prompt) + params.max_tokens} tokens of KV but no "
                                 "decode replica's whole cache holds them; it can never be decoded")
            # A request held by flow control arrived at the router before now: its TTFT counts the wait.
            engine.add_request(prompt, params, request_id=rid, arrival_time=min(now, spec.arrival_time),
                               priority=spec.priority, tenant=spec.tenant)
        except ValueError as e:
            engine.requests[rid] = engine.reject(prompt, params, str(e), request_id=rid,
                                                 arrival_time=min(now, spec.arrival_time))
            queued = False
        rep.admitted(rid, len(prompt), now, queued)
        if slot is None:
            order.append((rid, rep))
        else:
            order[slot] = (rid, rep)
        spec_of[rid] = spec

    t_first = specs[0].arrival_time if specs else 0.0
    for r in reps:
        r.started_at = r.ready_at = t_first
    scale_events: list[tuple[float, int]] = []
    ticks = 1          # the autoscaler decides at t_first + k * interval_s, k = 1, 2, ... (no drift)
    next_tick = t_first + scaler.interval_s if scaler is not None else float("inf")

    def sweep(now: float) -> None:
        """A draining replica with nothing left (no request, no move in flight) leaves."""
        for r in reps:
            if (r.draining and r.removed_at is None and not r.engine.has_unfinished_requests()
                    and (mig is None or not mig.busy(r))):
                r.removed_at = max(now, r.clock.now())

    watched: dict[int, tuple[int, set]] = {}     # replica index -> (ids seen, ids without a first token)

    def slo_watch(r, now: float) -> int:
        """Report new first tokens of replica ``r`` to the autoscaler; how many of its requests
        still wait for one past the TTFT SLO."""
        seen, waiting = watched.get(r.index, (0, set()))
        waiting.update(r.ids[seen:])
        late = 0
        for rid in list(waiting):
            req = r.engine.requests.get(rid)
            if req is None or (req.is_finished and req.first_token_time is None):
                waiting.discard(rid)                   # rejected or aborted: no first token to judge
            elif req.first_token_time is not None:
                scaler.record_first_token(req.first_token_time, req.first_token_time - req.arrival_time)
                waiting.discard(rid)
            elif now - req.arrival_time > scaler.slo["ttft"]:
                late += 1
        watched[r.index] = (len(r.ids), waiting)
        return late

    def tick(now: float) -> None:
        """One autoscaler decision at ``now`` (Ray Serve's control loop)."""
        live = [r for r in reps if r.removed_at is None and not r.draining]
        ready = [r for r in live if r.ready_at <= now + _EPS]
        target = len(live)
        if scaler.metric == "slo_attainment":
            overdue = 0
            for r in reps:
                if r.removed_at is None:
                    overdue += slo_watch(r, now)
            for r in ready:
                scaler.record(r.index, now, float(r.view(now).num_requests))
            total = sum(scaler.average(r.index) for r in ready)
            new = scaler.decide(target, total, scaler.desired_slo(target, scaler.attainment(now, overdue), total))
        else:
            for r in ready:
                scaler.record(r.index, now, scaler.value(r.view(now)))
            total = sum(scaler.average(r.index) for r in ready)
            new = scaler.decide(target, total)
        if new == target:
            return
        if new > target:
            for _ in range(new - target):
                rep = Replica(len(reps), make_engine(names[0]), names[0])
                rep.started_at, rep.ready_at = now, now + scaler.cold_start_s
                rep.engine.clock.advance_to(rep.ready_at)
                reps.append(rep)
                by_model.setdefault(rep.model, []).append(rep)
        else:
            n = target - new
            starting = sorted((r for r in live if r.ready_at > now + _EPS), key=lambda r: -r.index)
            for r in starting[:n]:
                r.removed_at = now            # never served: stop it
            n -= min(n, len(starting))
            order_ = sorted(ready, key=lambda r: (r.view(now).num_requests, -r.index))
            for r in order_[:n]:
                r.draining, r.drain_at = True, now
        sweep(now)
        scale_events.append((now, new))

    mig = None
    if migration:
        from minibatch.cluster.migration import Migration, Migrator
        mig = Migrator(migration if isinstance(migration, Migration) else Migration(), t_first)

    fq = None
    checks: list[float] = []                   # heap: ends of steps, when a replica may have room again
    held_wait: dict[str, float] = {}           # request id -> seconds held at the router
    if flow_control is not None:
        from minibatch.cluster.flow_control import FlowControl, FlowQueue
        if not isinstance(flow_control, FlowControl):
            raise TypeError(f"flow_control= must be a FlowControl, got {type(flow_control).__name__}")
        if models is not None or len({r.model for r in reps}) > 1:
            raise ValueError("flow_control= goes with one model (its queue would block one model's "
                             "requests behind another's)")
        fq = FlowQueue(flow_control)

    def hold(spec, now: float) -> None:
        """Flow control: an arrival waits at the router (or is rejected if the queue is full)."""
        rid = spec.request_id if spec.request_id is not None else f"r{len(order)}"
        slot = len(order)
        order.append((rid, None))
        if not candidates_of(spec, now):
            route(spec, now, rid, slot)           # no replica serves it: rejected with the reason
            return
        can_go = len(fq) == 0 and any(fq.control.has_room(r.view(now)) for r in candidates_of(spec, now))
        if fq.full() and not can_go:          # max_queued bounds the held requests, not those that go at once
            fq.rejected += 1
            unserved[rid] = RequestRecord(
                rid, now, spec.prompt_len, 0, spec.priority, spec.tenant, finish_time=now,
                finish_reason="rejected", model=spec.model,
                error=f"flow control: {fq.control.max_queued} requests already wait at the router "
                      "(max_queued); retry later")
            return
        fq.push((spec, rid, slot, now), spec.priority, spec.tenant, now)
        release(now)

    def release(now: float) -> None:
        """Flow control at ``now``: reject what waited too long, then release held requests, next
        first (band, then fairness, then FCFS), while a replica has room."""
        for spec, rid, slot, since in fq.expire(now):
            unserved[rid] = RequestRecord(
                rid, spec.arrival_time, spec.prompt_len, 0, spec.priority, spec.tenant, finish_time=now,
                finish_reason="rejected", model=spec.model,
                error=f"flow control: held at the router for queue_timeout_s={fq.control.queue_timeout_s} s "
                      "and no replica had room")
        while len(fq):
            spec, rid, slot, since = fq.peek()
            room = [r for r in candidates_of(spec, now) if fq.control.has_room(r.view(now))]
            if not room:
                return
            fq.pop()
            held_wait[rid] = now - since
            route(spec, now, rid, slot, among=room)

    inf = float("inf")
    pending = deque(specs)
    while True:
        nxt = min(reps, key=lambda r: r.next_event_time())
        t_rep = nxt.next_event_time()
        t_move = mig.next_event() if mig is not None else inf
        t_xfer = pd.next_event() if pd is not None else inf
        t_fail = fo.next_event() if fo is not None else inf
        # The periodic decisions run while something is still due (an arrival, a step, a move's
        # stage); once nothing is, they could not make a stuck replica progress.
        due = bool(pending) or t_rep < inf or t_move < inf or t_xfer < inf
        t_tick = next_tick if due else inf
        t_mtick = mig.next_tick if mig is not None and due else inf
        t_fail = t_fail if due else inf
        t_fc = inf
        if fq is not None:
            t_fc = min(checks[0] if checks else inf, fq.next_expiry())
        t_next = min(t_rep, t_tick, t_move, t_mtick, t_xfer, t_fail, t_fc)
        if pending and pending[0].arrival_time <= t_next + _EPS:
            spec = pending.popleft()
            if fq is None:
                route(spec, spec.arrival_time)
            else:
                hold(spec, spec.arrival_time)
            continue
        if t_fc <= t_next and t_fc < inf:
            # Before any step that starts at t_fc: a released request joins that step.
            while checks and checks[0] <= t_fc + _EPS:
                heapq.heappop(checks)
            release(t_fc)
            continue
        if t_fail <= t_next and t_fail < inf:
            fo.fire(reps, rt, spec_of, t_fail)
            continue
        if t_tick <= t_next and t_tick < inf:
            tick(t_tick)
            if fq is not None:
                heapq.heappush(checks, t_tick + scaler.cold_start_s)   # a new replica may be ready
            ticks += 1
            next_tick = t_first + ticks * scaler.interval_s
            continue
        if t_move <= t_next and t_move < inf:
            mig.fire(t_move)
            if scaler is not None:
                sweep(t_move)
            continue
        if t_xfer <= t_next and t_xfer < inf:
            pd.fire(t_xfer)
            continue
        if t_mtick <= t_next and t_mtick < inf:
            mig.tick(t_mtick, reps)
            continue
        if t_rep == inf:
            if fq is not None and len(fq):
                # Nothing will ever run again and requests are still held: none of them can be
                # served (no live replica serves them); reject them, never drop them.
                t_end = max([t_next if t_next < inf else 0.0] + [r.clock.now() for r in reps])
                while len(fq):
                    spec, rid, slot, since = fq.pop()
                    fq.rejected += 1
                    unserved[rid] = RequestRecord(
                        rid, spec.arrival_time, spec.prompt_len, 0, spec.priority, spec.tenant,
                        finish_time=t_end, finish_reason="rejected", model=spec.model,
                        error="flow control: held at the router and no live replica serves it")
            stuck = [r for r in reps if r.engine.has_unfinished_requests()]
            if pd is not None and pd.ready:
                raise RuntimeError(f"{len(pd.ready)} prefilled requests wait for a decode replica "
                                   "and none will ever have room")
            if stuck:
                r = stuck[0]
                raise RuntimeError(f"replica {r.index} made no progress and nothing is due: policy "
                                   f"{r.engine.scheduler.policy.name!r} holds {r.engine.num_waiting} "
                                   "waiting requests forever")
            break
        step = nxt.step()
        if fq is not None:
            heapq.heappush(checks, nxt.clock.now())   # its step's end: finished requests free room
        if pd is not None:
            if nxt in pd.prefill:
                pd.after_prefill_step(nxt)        # prefilled requests leave for the decode pool
            else:
                pd.try_start(nxt.clock.now())     # blocks freed on a decode replica
        if nxt.draining:
            sweep(nxt.clock.now())               # drained: it leaves when its last step ends
        if step is not None and on_step is not None:
            on_step(nxt.index, nxt.engine, step)

    records: list[RequestRecord] = []
    per_replica: list[list[RequestRecord]] = [[] for _ in reps]
    for i, (rid, rep) in enumerate(order):
        if rep is None:
            rec = unserved[rid]
        else:
            if mig is not None:
                rep = mig.moved_to.get(rid, rep)      # where it finished
            if pd is not None:
                rep = pd.moved_to.get(rid, rep)
            if fo is not None:
                rep = fo.moved_to.get(rid, rep)
            rec = RequestRecord.of(rep.engine.requests[rid], keep_tokens=keep_tokens)
            rec.replica = rep.index
            rec.model = specs[i].model
            per_replica[rep.index].append(rec)
        records.append(rec)
    wall = time.perf_counter() - wall0
    results = [RunResult(per_replica[r.index], list(r.engine.steps), r.engine.config.to_dict(), [],
                         r.engine.kv.num_blocks, wall, extra={"model": r.model}) for r in reps]
    extra: dict = {"routed": [len(r.ids) for r in reps]}   # where each request was routed (before moves)
    if mig is not None:
        extra["migrations"] = mig.migrations
        extra["kv_transfer_bytes"] = mig.kv_transfer_bytes
        extra["migration_log"] = mig.log
        extra["migrations_abandoned"] = mig.abandoned
    if fq is not None:
        extra["flow_control"] = {"held_wait": held_wait, "max_held": fq.max_len,
                                 "released": fq.released, "rejected": fq.rejected}
    if fo is not None:
        extra["failures"] = fo.log
        extra["redispatched"] = fo.redispatched
    from minibatch.cluster.disagg import gpus_of
    extra["gpus"] = sum(gpus_of(r.engine) for r in reps)
    if pd is not None:
        extra["kv_transfers"] = len(pd.log)
        extra["kv_transfer_bytes"] = pd.kv_transfer_bytes
        extra["transfer_log"] = pd.log
        extra["max_in_flight_blocks"] = pd.max_in_flight_blocks
        extra["prefill_replica"] = {rid: rep.index for rid, rep in order if rep is not None}
        extra["pools"] = {"prefill": [r.index for r in pd.prefill], "decode": [r.index for r in pd.decode],
                          "prefill_results": [results[r.index] for r in pd.prefill],
                          "decode_results": [results[r.index] for r in pd.decode]}
    if scaler is not None:
        extra["scale_events"] = scale_events
        extra["lifetimes"] = [(r.started_at, r.removed_at) for r in reps]   # (start, removal or None)
        extra["ready_at"] = [r.ready_at for r in reps]
        extra["drain_at"] = [r.drain_at for r in reps]
    return ClusterResult(records, results, rt.name, [r.model for r in reps], wall, extra=extra)
