"""Prefill/decode disaggregation (after DistServe, Zhong et al., OSDI'24, and Splitwise, Patel et al., ISCA'24).

``cluster.run(..., disaggregation=Disaggregation(prefill=P, decode=D, link_gbps=..., link_latency_s=...))``
runs P *prefill* replicas (indices ``0..P-1``) and D *decode* replicas (``P..P+D-1``), each
pool on its own hardware if ``prefill_hardware`` / ``decode_hardware`` name one (simulator).

**A request's path.** The router (``cluster.run``'s ``router=``) picks a prefill replica among
the prefill pool. That replica computes the prompt and samples the first token (its TTFT is
measured there: ``first_token_time`` is set by the prefill engine). At the end of that step
the request leaves the prefill replica's scheduler (it never runs a decode step there) and
its prompt's KV blocks are sent to a decode replica: the decode pool's router
(``decode_router``: a registered router name, seeing the decode replicas'
:class:`~minibatch.cluster.ReplicaView` s; default ``None``: the least loaded by virtual KV
usage, ``minibatch.cluster.migration.load``) picks one among the decode replicas that have
the free blocks now: the prompt's blocks plus room for the next token. If none has, the
request waits (first come, first served) holding its prefill blocks, and the transfers are
retried after every decode step. A request with ``max_tokens=1`` finishes on the prefill
replica and transfers nothing.

**The transfer** lasts ``kv_bytes / link_bytes_per_s + link_latency_s`` with ``kv_bytes =
blocks x block bytes`` (``ceil(prompt / block_size)`` blocks; block bytes as migration prices
them: the model executor's ``block_bytes`` or the cost model's KV bytes per token per GPU x
``block_size``). **The link is shared:** every replica has one link of ``link_gbps`` (its NIC),
so a prefill replica sends one transfer at a time and a decode replica receives one at a
time, first come first served. A transfer starts at ``t0 = max(t_ready, both ends' links
free)`` (``t_ready``: the end of the prefill step, or the time a decode replica had room) and
holds both links for ``kv_bytes / link_bytes_per_s``; the latency delays its end but holds no
link. So each link's utilisation, ``rate through it x kv_bytes / link_bytes_per_s`` (a prefill
replica's outgoing, a decode replica's incoming requests), must stay below 1, or transfers
queue without bound. From ``t_ready`` to the transfer's end the request holds its blocks on
both sides (``in_flight`` counts them; the decode side's are reserved when the destination is
chosen). At the transfer's end (``t_end``) the prefill replica frees its blocks (once) and the
request joins the decode replica's running requests; a decode replica busy in a step takes it
in its next step. With ``executor="model"`` the blocks are really copied between the engines'
``kv_caches`` when the destination is chosen (they cannot change afterwards), so greedy tokens
equal a single engine's.
``link_gbps=float("inf")`` makes the link free (latency only).

``ClusterResult.extra``: ``pools`` (``{"prefill": [replica indices], "decode": [...],
"prefill_results": [RunResult], "decode_results": [RunResult]}``), ``transfer_log`` (one entry
per transfer: request, src, dst, ``t_ready`` (prefill done), ``t0``, ``t_end``, blocks, bytes),
``kv_transfers`` and ``kv_transfer_bytes`` (also in ``summary()``), ``prefill_replica`` (request id ->
the prefill replica it was routed to; ``ClusterResult.requests[i].replica`` is where it finished),
``max_in_flight_blocks`` (most blocks held twice at once). ``summary()["routed"]`` counts the
arrivals routed to each prefill replica and the transfers each decode replica received.

:func:`goodput_per_gpu` is DistServe's figure of merit: the highest rate at which at least
90% of requests meet both the TTFT and the TPOT SLO (``minibatch.results.capacity``), divided
by the cluster's GPU count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.cluster.migration import block_bytes, copy_blocks, load
from minibatch.request import RequestStatus


@dataclass
class Disaggregation:
    prefill: int = 1
    decode: int = 1
    link_gbps: float = 100.0
    link_latency_s: float = 0.0
    prefill_hardware: str | None = None
    decode_hardware: str | None = None
    decode_router: object = None          # None: least virtual KV usage; else a router name/class/instance
    decode_router_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if int(self.prefill) < 1 or int(self.decode) < 1:
            raise ValueError(f"a disaggregated cluster needs prefill >= 1 and decode >= 1 replicas, "
                             f"got prefill={self.prefill}, decode={self.decode}")
        if not self.link_gbps > 0 or self.link_latency_s < 0:
            raise ValueError("link_gbps must be > 0 (inf: a free link) and link_latency_s >= 0")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8

    def seconds(self, nbytes: int) -> float:
        """What sending ``nbytes`` over the link costs: ``nbytes / bandwidth + latency``."""
        return nbytes / self.link_bytes_per_s + self.link_latency_s


@dataclass
class Transfer:
    req: object
    src: object                   # Replica (prefill)
    dst: object                   # Replica (decode)
    t_ready: float
    t0: float
    t_end: float
    blocks: int
    nbytes: int
    dst_blocks: list = field(default_factory=list)

    @property
    def rid(self) -> str:
        return self.req.request_id


class Disaggregator:
    """The runner's side of :class:`Disaggregation`: requests prefilled, transfers in flight."""

    def __init__(self, cfg: Disaggregation, prefill, decode):
        from minibatch.cluster import routers as _routers

        self.cfg = cfg
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.router = None if cfg.decode_router is None else _routers.get(cfg.decode_router, **cfg.decode_router_kwargs)
        self.ready: list[tuple[object, object, float]] = []   # (request, prefill replica, t_ready), FIFO
        self.transfers: list[Transfer] = []
        self.log: list[dict] = []
        self.kv_transfer_bytes = 0
        self.moved_to: dict = {}
        self.max_in_flight_blocks = 0    # most blocks held twice (both sides) at once
        self.link_free_at: dict[int, float] = {}   # replica index -> when its link is free again

    # -- time ----------------------------------------------------------------------
    def next_event(self) -> float:
        return min((t.t_end for t in self.transfers), default=float("inf"))

    def in_flight(self) -> int:
        """Requests prefilled and not yet on a decode replica (waiting for room or in transfer)."""
        return len(self.ready) + len(self.transfers)

    def in_flight_blocks(self) -> tuple[int, int]:
        """``(prefill-side, decode-side)`` blocks held by requests between the pools."""
        src = sum(len(r.engine.kv.block_table(q.request_id)) for q, r, _ in self.ready)
        src += sum(len(t.src.engine.kv.block_table(t.rid)) for t in self.transfers)
        dst = sum(len(t.dst_blocks) for t in self.transfers)
        return src, dst

    def can_ever_decode(self, num_tokens: int) -> bool:
        return any(r.engine.kv.blocks_for_request(num_tokens) <= r.engine.kv.num_blocks for r in self.decode)

    # -- after a prefill replica's step ------------------------------------------------
    def after_prefill_step(self, rep) -> None:
        """Take the requests whose prompt this step finished (they have their first token)
        out of the prefill replica's scheduler; they wait for a decode replica."""
        sched = rep.engine.scheduler
        t = rep.clock.now()
        for req in list(sched.running):
            if req.num_output_tokens >= 1 and req.status is RequestStatus.RUNNING and not req.is_finished:
                sched.running.remove(req)
                self.ready.append((req, rep, t))
        self.try_start(t)

    def _need(self, req, dst) -> int:
        return dst.engine.kv.blocks_for(req.num_tokens)     # the prompt's blocks + room for the next token

    def _pick(self, req, now: float):
        fits = [r for r in self.decode if self._need(req, r) <= r.engine.kv.num_free_blocks
                and r.engine.kv.allocator == "paged"]
        if not fits:
            return None
        if self.router is None:
            return min(fits, key=lambda r: (load(r.engine), r.index))
        views = [r.view(now, None) for r in fits]
        pos = self.router.choose(req, views, now)
        if not isinstance(pos, int) or not 0 <= pos < len(fits):
            raise ValueError(f"decode router {self.router.name!r} chose {pos!r}; expected 0..{len(fits) - 1}")
        return fits[pos]

    def try_start(self, now: float) -> None:
        """Start the waiting transfers, first come first served, while a decode replica has room."""
        while self.ready:
            req, src, t_ready = self.ready[0]
            dst = self._pick(req, max(now, t_ready))
            if dst is None:
                return
            self.ready.pop(0)
            kv_s, kv_d = src.engine.kv, dst.engine.kv
            n = kv_s.blocks_for(req.num_computed_tokens)
            nbytes = n * block_bytes(src.engine)
            # Both ends' links carry one transfer at a time: wait until both are free.
            free = self.link_free_at
            t0 = max(now, t_ready, free.get(src.index, t_ready), free.get(dst.index, t_ready))
            free[src.index] = free[dst.index] = t0 + nbytes / self.cfg.link_bytes_per_s
            tr = Transfer(req, src, dst, t_ready, t0, t0 + self.cfg.seconds(nbytes), n, nbytes)
            tr.dst_blocks = kv_d.pool.allocate(n)
            kv_d.req_blocks[req.request_id] = tr.dst_blocks
            copy_blocks(src.engine, dst.engine, kv_s.block_table(req.request_id)[:n], tr.dst_blocks)
            self.kv_transfer_bytes += nbytes
            self.transfers.append(tr)
            self.max_in_flight_blocks = max(self.max_in_flight_blocks, sum(self.in_flight_blocks()))

    # -- a transfer ends ---------------------------------------------------------------
    def fire(self, now: float) -> None:
        tr = min(self.transfers, key=lambda t: t.t_end)
        req, src, dst = tr.req, tr.src, tr.dst
        src.engine.kv.free(req)               # the prefill side's blocks, freed once, after the copy
        src.engine.scheduler.policy.on_finished(req)
        src.engine.requests.pop(tr.rid, None)
        src.blocked_until = None              # a prefill replica short of blocks may admit again
        eng = dst.engine
        eng.requests[tr.rid] = req
        eng.clock.advance_to(now)             # an idle decode replica waits for it; a busy one is past it
        eng.scheduler.running.append(req)
        dst.blocked_until = None
        dst.ids.append(tr.rid)
        self.transfers.remove(tr)
        self.moved_to[tr.rid] = dst
        self.log.append({"request_id": tr.rid, "src": src.index, "dst": dst.index, "t_ready": tr.t_ready,
                         "t0": tr.t0, "t_end": tr.t_end, "blocks": tr.blocks, "bytes": tr.nbytes})


def gpus_of(engine) -> int:
    """GPUs one replica uses: the simulator's tensor-parallel degree, else 1."""
    return int(getattr(getattr(engine.executor, "cost_model", None), "tp", 1) or 1)


def goodput_per_gpu(workload_at, slo: dict[str, float], target: float = 0.9, lo: float = 0.25,
                    hi: float = 64.0, tol: float = 0.05, trim: float = 0.0, **run_kwargs) -> float:
    """DistServe's goodput per GPU: the highest request rate at which at least ``target`` of the
    requests meet every bound of ``slo`` (e.g. ``{"ttft": 1.0, "tpot": 0.05}``), found by
    :func:`minibatch.results.capacity` (bisection between ``lo`` and ``hi`` req/s), divided by
    the cluster's GPU count. ``workload_at(rate)`` builds the workload at that rate;
    ``run_kwargs`` go to :func:`minibatch.cluster.run` (``replicas=`` or ``disaggregation=``, ...).
    """
    from minibatch.cluster.runner import run
    from minibatch.results import capacity

    gpus = []

    def attainment(rate: float) -> float:
        res = run(workload_at(rate), **run_kwargs)
        gpus.append(res.extra["gpus"])
        return res.summary(slo=slo, trim=trim)["slo_attainment"]

    rate = capacity(attainment, target=target, lo=lo, hi=hi, tol=tol)
    return rate / gpus[0]
