"""Live migration of running requests with their KV blocks (after Llumnix, Sun et al., OSDI'24).

Every ``interval_s`` of virtual time the migrator compares the replicas' loads and, when they
are imbalanced, moves one running decode request from the most loaded replica to the least
loaded one, with its KV blocks.

**The load.** Llumnix's ``KvBlocksRatioLoad`` (``AlibabaPAI/llumnix``,
``llumnix/load_computation.py`` at commit 9529a78): ``demand_factor = (KV blocks in use +
blocks all waiting requests need) / KV blocks of the replica``, the paper's "virtual usage" in
which queued requests' demand counts as well as the blocks in use. A move is triggered when
``max load - min load > imbalance`` (default 0.2) among the replicas that serve (ready, not
draining), the source has a running request in decode with at least ``min_remaining_tokens``
still to generate, and neither replica takes part in a move already. The request moved is the
one with the fewest KV blocks (the cheapest copy), as long as the destination has the free
blocks for it and the move narrows the gap (``b / M_src + b / M_dst < 2 x gap`` for ``b``
blocks, so that a request does not ping-pong between two replicas). Llumnix's own pairing
(``llumnix/global_scheduler/migration_policy.py``, ``Balanced``) pairs the most loaded with the
least loaded replicas in order and moves when ``0 < gap after < gap before`` and the
destination's load after the move stays under ``migrate_out_load_threshold``; the
``imbalance`` trigger and the cheapest-request choice here are minibatch's own simplification
(one move per decision, one pair), and minibatch allows a move that overshoots by less than the
gap it closes.

**The move**, staged as Llumnix's live migration (copy while decoding, then a short paused stage): at ``t0`` the destination reserves
blocks and the *full* blocks the request holds at ``t0`` are copied while it keeps decoding
on the source (a partly filled block is still being written, so it waits); stage 1 lasts
``full blocks x block bytes / link``. At its end (or when the source's step in flight then
ends, ``t_p``) the request is paused on the source and a short final stage copies the rest:
the blocks written since ``t0`` (the partial one included), ``blocks x block bytes / link``.
At ``t_r = t_p + final stage`` the source frees its blocks (once) and the request resumes on
the destination, whose scheduler runs it as any running request. If the request finished or
was preempted during stage 1, or the destination has no room for the final stage, the move is
abandoned: the destination frees what it reserved and the request stays on (or goes back to)
the source. No token is lost or recomputed either way.

Cost: ``link_gbps`` (default 100 Gb/s: one 100 GbE / InfiniBand EDR link between two
machines) and ``link_latency_s`` per stage (default 0). Block bytes: the model executor's
``block_bytes`` (K and V, all layers) or, in the simulator, the cost model's KV bytes per
token per GPU x ``block_size`` (as ``minibatch.swap`` prices a swap). With ``executor="model"``
the blocks are really copied from the source engine's ``kv_caches`` into the destination's
(``index_select`` / ``index_copy_`` per layer, at ``t_p``: the full blocks of stage 1 cannot
change after ``t0``), so greedy tokens equal a single engine's; with the simulator the copy
is modelled (time only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.request import RequestStatus


@dataclass
class Migration:
    interval_s: float = 0.1
    link_gbps: float = 100.0
    link_latency_s: float = 0.0
    imbalance: float = 0.2
    min_remaining_tokens: int = 2

    def __post_init__(self):
        if self.interval_s <= 0 or self.link_gbps <= 0:
            raise ValueError("interval_s and link_gbps must be > 0")
        if self.link_latency_s < 0 or not 0 <= self.imbalance <= 1:
            raise ValueError("link_latency_s must be >= 0 and imbalance in [0, 1]")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8


def block_bytes(engine) -> int:
    ex = engine.executor
    b = getattr(ex, "block_bytes", None)
    if b is None:
        per_token = getattr(getattr(ex, "cost_model", None), "kv_bytes_per_token_per_gpu", 0)
        b = per_token * engine.kv.block_size
    return int(b)


def copy_blocks(src_engine, dst_engine, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy KV blocks ``src_ids`` of ``src_engine`` into blocks ``dst_ids`` of ``dst_engine``
    (every layer's K and V); nothing to do unless both run the real model (``kv_caches``)."""
    src_c = getattr(src_engine.executor, "kv_caches", None)
    dst_c = getattr(dst_engine.executor, "kv_caches", None)
    if src_c is None or dst_c is None or not src_ids:
        return
    import torch

    si = torch.tensor(list(src_ids), dtype=torch.long, device=src_c[0][0].device)
    di = torch.tensor(list(dst_ids), dtype=torch.long, device=dst_c[0][0].device)
    with torch.inference_mode():
        for (ks, vs), (kd, vd) in zip(src_c, dst_c):
            kd.index_copy_(0, di, ks.index_select(0, si).to(kd.device))
            vd.index_copy_(0, di, vs.index_select(0, si).to(vd.device))


def load(engine) -> float:
    """Virtual usage: (blocks in use + blocks the waiting requests need) / blocks."""
    kv = engine.kv
    demand = sum(kv.blocks_for(r.num_tokens) for r in engine.scheduler.waiting)
    return (kv.num_used_blocks + demand) / kv.num_blocks


@dataclass
class Move:
    req: object
    src: object                  # Replica
    dst: object                  # Replica
    t0: float
    copied_full: int             # full blocks copied in stage 1
    stage: int = 1               # 1: copying while decoding; 2: paused, final copy
    t_event: float = 0.0         # end of the current stage
    dst_blocks: list = field(default_factory=list)
    t_pause: float | None = None
    final_blocks: int = 0

    @property
    def rid(self) -> str:
        return self.req.request_id


class Migrator:
    """The runner's side of :class:`Migration`: ticks, moves in flight, counters."""

    def __init__(self, cfg: Migration, t_start: float):
        self.cfg = cfg
        self.t_start = t_start
        self.ticks = 1
        self.next_tick = t_start + cfg.interval_s    # decisions at t_start + k * interval_s
        self.moves: list[Move] = []
        self.migrations = 0          # moves completed
        self.abandoned = 0
        self.kv_transfer_bytes = 0
        self.log: list[dict] = []    # one entry per completed move (times, blocks)
        self.moved_to: dict = {}     # request id -> the replica it last moved to

    # -- time --------------------------------------------------------------------
    def next_event(self) -> float:
        return min((m.t_event for m in self.moves), default=float("inf"))

    def busy(self, rep) -> bool:
        return any(m.src is rep or m.dst is rep for m in self.moves)

    def _secs(self, nbytes: int) -> float:
        return self.cfg.link_latency_s + nbytes / self.cfg.link_bytes_per_s

    # -- a decision ----------------------------------------------------------------
    def tick(self, now: float, reps) -> None:
        self.ticks += 1
        self.next_tick = self.t_start + self.ticks * self.cfg.interval_s
        serving = [r for r in reps if r.serving(now) and not self.busy(r)]
        if len(serving) < 2:
            return
        loads = {r.index: load(r.engine) for r in serving}
        src = max(serving, key=lambda r: (loads[r.index], -r.index))
        dst = min(serving, key=lambda r: (loads[r.index], r.index))
        if src is dst or loads[src.index] - loads[dst.index] <= self.cfg.imbalance:
            return
        if src.model != dst.model:
            return
        kv_s, kv_d = src.engine.kv, dst.engine.kv
        cands = []
        for req in src.engine.scheduler.running:
            remaining = req.sampling_params.max_tokens - req.num_output_tokens
            if (req.status is RequestStatus.RUNNING and req.num_output_tokens >= 1
                    and req.num_computed_tokens == req.num_tokens - 1 and remaining >= self.cfg.min_remaining_tokens
                    and kv_s.allocator == "paged"):
                cands.append(req)
        if not cands:
            return
        req = min(cands, key=lambda r: (len(kv_s.block_table(r.request_id)), r.request_id))
        # only a move that narrows the gap (no ping-pong): |gap after| < gap before
        b = len(kv_s.block_table(req.request_id))
        if b / kv_s.num_blocks + b / kv_d.num_blocks >= 2 * (loads[src.index] - loads[dst.index]):
            return
        full = req.num_computed_tokens // kv_s.block_size
        # the destination must hold the request now plus a block to grow, without preempting
        if kv_d.blocks_for(req.num_tokens + 1) > kv_d.num_free_blocks:
            return
        move = Move(req, src, dst, now, full)
        move.dst_blocks = kv_d.pool.allocate(full)
        kv_d.req_blocks[req.request_id] = move.dst_blocks
        nbytes = full * block_bytes(src.engine)
        self.kv_transfer_bytes += nbytes
        move.t_event = now + self._secs(nbytes)
        self.moves.append(move)

    # -- a stage ends ----------------------------------------------------------------
    def fire(self, now: float) -> None:
        move = min(self.moves, key=lambda m: m.t_event)
        if move.stage == 1:
            self._pause(move, now)
        else:
            self._resume(move, now)

    def _abandon(self, move: Move) -> None:
        kv_d = move.dst.engine.kv
        kv_d.req_blocks.pop(move.rid, None)
        if move.dst_blocks:
            kv_d.pool.release(list(reversed(move.dst_blocks)))
        self.moves.remove(move)
        self.abandoned += 1

    def _pause(self, move: Move, now: float) -> None:
        req, src, dst = move.req, move.src, move.dst
        sched = src.engine.scheduler
        if req.is_finished or req.status is not RequestStatus.RUNNING or req not in sched.running:
            self._abandon(move)               # finished or preempted while stage 1 copied
            return
        t_p = max(now, src.clock.now())       # a step in flight on the source ends first
        kv_s, kv_d = src.engine.kv, dst.engine.kv
        total = kv_s.blocks_for(req.num_computed_tokens)
        rest = total - move.copied_full
        if rest > kv_d.num_free_blocks:
            self._abandon(move)
            return
        sched.running.remove(req)             # paused: the source's scheduler no longer runs it
        move.dst_blocks += kv_d.pool.allocate(rest)
        kv_d.req_blocks[move.rid] = move.dst_blocks
        self._copy_data(move, total)
        nbytes = rest * block_bytes(src.engine)
        self.kv_transfer_bytes += nbytes
        move.stage = 2
        move.t_pause = t_p
        move.final_blocks = rest
        move.t_event = t_p + self._secs(nbytes)

    def _copy_data(self, move: Move, n: int) -> None:
        copy_blocks(move.src.engine, move.dst.engine, move.src.engine.kv.block_table(move.rid)[:n],
                    move.dst_blocks[:n])

    def _resume(self, move: Move, now: float) -> None:
        req, src, dst = move.req, move.src, move.dst
        src.engine.kv.free(req)               # the source's blocks, freed once, after the copy
        src.engine.scheduler.policy.on_finished(req)
        src.engine.requests.pop(move.rid, None)
        eng = dst.engine
        eng.requests[move.rid] = req
        eng.clock.advance_to(now)             # an idle destination waits for it; a busy one is past it
        eng.scheduler.running.append(req)
        dst.blocked_until = None
        self.moves.remove(move)
        self.migrations += 1
        self.log.append({"request_id": move.rid, "src": src.index, "dst": dst.index, "t0": move.t0,
                         "t_pause": move.t_pause, "t_resume": now, "stage1_blocks": move.copied_full,
                         "final_blocks": move.final_blocks})
        self.moved_to[move.rid] = dst
