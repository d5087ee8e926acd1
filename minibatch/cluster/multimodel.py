"""Several models on one GPU: memory partitioning or time-slicing, and routing by model.

Each GPU of a *placement* (``[["llama-2-7b", "llama-2-13b"]]``: one GPU, two models;
``[["a"], ["b"]]``: a GPU each; ``[["a", "b"], ["a", "b"]]``: both models on both GPUs) shares
its memory and its compute among the models placed on it, in one of two ways.

**Memory partitioning** (``mode="partition"``, spatial sharing). Every model stays resident in
a fixed share ``s_m`` of the GPU's memory ``M``, as K vLLM servers started on one GPU, each
with ``--gpu-memory-utilization s_m`` (vLLM 0.11.0 ``vllm/config/cache.py``: "a per-instance
limit ... two vLLM instances on the same GPU ... 0.5 for each instance"). Each model's KV pool
is what its share leaves after its weights ``W_m`` and a reserve ``R`` (activations, CUDA
context: ``minibatch.sim.cost_model.DEFAULT_ACTIVATION_RESERVE_BYTES``)::

    KV tokens_m = floor((s_m * M - W_m - R) / kv_bytes_per_token_m)

A share *fits* when its KV holds at least ``min_kv_tokens`` (default: one request of the
model's ``max_model_len``, the check vLLM 0.11.0 makes at start-up,
``check_enough_kv_cache_memory`` in ``vllm/v1/core/kv_cache_utils.py``). :func:`partition_shares`
gives every model its weights and reserve plus a part ``f_m`` of the memory left over::

    s_m = (W_m + R + f_m * (u * M - sum_k (W_k + R))) / M        (u: gpu_memory_utilization)

The models' steps share the GPU's compute. Without NVIDIA MPS, kernels of different processes
do not run at the same time: the GPU switches between their contexts (NVIDIA MPS
documentation, "When to Use MPS"). So here a GPU runs one engine step at a time, taking the
models that have work in turn (round robin, step by step). Decode steps are bound by memory
bandwidth, so running them concurrently would not make them much shorter either.

**Time-slicing** (``mode="time_slice"``, temporal sharing). One model is resident at a time
with the whole ``gpu_memory_utilization`` for its weights and KV (the first model of the GPU's
list at the start); requests for the others wait. A switch from ``a`` to ``b`` stops handing
new requests to ``a``, lets ``a`` finish the requests it holds (drain), drops ``a``'s weights
(a copy stays in host memory, as vLLM's ``LLM.sleep(level=1)`` keeps it, vLLM 0.11.0
``vllm/entrypoints/llm.py``) and copies ``b``'s weights in over the host link::

    t_switch = W_b / B_host + switch_overhead_s      (B_host: PCIe Gen4 x16, minibatch.swap)

The resident model keeps the GPU while it has work, unless another model waits and the
resident one has held the GPU for ``max_slice_s`` (then it drains). An idle resident model
gives the GPU to the model whose oldest waiting request arrived first. The KV of a model
that leaves is discarded (it has no running request left; its prefix cache is lost).

**Routing.** A request asks for ``RequestSpec.model``; among the GPUs that hold that model,
``router`` (a ``minibatch.cluster.routers`` class) picks one from the ``ReplicaView`` s of that
model's engines (a time-sliced engine's view counts the requests held for it as waiting).
With one model per GPU and ``mode="partition"`` (whose share is then the whole
``gpu_memory_utilization``), ``run`` does what ``minibatch.cluster.run(models=[...])`` does:
the same records, times and steps.

Cost: ``summary()["gpu_seconds"]`` = GPUs x the run's span (first arrival to last step's end),
what the provisioned GPUs cost, busy or not. Statistical multiplexing (AlpaServe, Li et al.,
OSDI'23): placing every model on every GPU lets a burst of one model use all the GPUs.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from minibatch.cluster import routers as _routers
from minibatch.cluster.replica import Replica
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.results import RequestRecord, RunResult, summarize
from minibatch.runner import _prepare_workload, with_fewer_gc_passes
from minibatch.sampling_params import SamplingParams
from minibatch.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES, ModelDoesNotFitError, make_cost_model
from minibatch.swap import HOST_LINK_BYTES_PER_S

MODES = ("partition", "time_slice")
_EPS = 1e-12


# -- memory: what fits -----------------------------------------------------------------------

def memory_bytes(hardware: str) -> int:
    """Memory of one GPU of ``hardware`` (the simulator's catalogue, ``minibatch.sim.hardware``)."""
    from minibatch.sim.hardware import parse_hardware

    return parse_hardware(hardware)[0].memory_bytes


def weight_bytes(arch: str, hardware: str) -> int:
    """Weight bytes of ``arch`` on each GPU of ``hardware`` (``weight_bytes / tp``)."""
    return make_cost_model(arch, hardware).weight_bytes_per_gpu


def kv_tokens(arch: str, hardware: str, share: float) -> int:
    """KV tokens that ``share`` of a GPU's memory holds after ``arch``'s weights and the reserve,
    ``floor((share * M - W - R) / kv_bytes_per_token)``; 0 if the weights do not fit."""
    try:
        return make_cost_model(arch, hardware).kv_capacity_tokens(share)
    except ModelDoesNotFitError:
        return 0


def min_kv_tokens(arch: str) -> int:
    """The least KV a server of ``arch`` starts with: one request of its ``max_model_len``."""
    from minibatch.sim import get_model_spec

    return get_model_spec(arch).max_model_len


def partition_shares(archs: dict[str, str], hardware: str, gpu_memory_utilization: float = 0.9,
                     kv_split: dict[str, float] | None = None) -> dict[str, float]:
    """Memory shares for the models ``archs`` (served name -> architecture) on one GPU:
    each its weights and reserve, plus ``kv_split[m]`` (default equal parts) of what is left of
    ``gpu_memory_utilization`` of the memory. Raises ``ModelDoesNotFitError`` if nothing is left."""
    if not archs:
        raise ValueError("partition_shares needs at least one model")
    mem = memory_bytes(hardware)
    fixed = {m: weight_bytes(a, hardware) + DEFAULT_ACTIVATION_RESERVE_BYTES for m, a in archs.items()}
    left = gpu_memory_utilization * mem - sum(fixed.values())
    if left <= 0:
        raise ModelDoesNotFitError(
            f"{sorted(archs)} do not fit together on one {hardware}: weights + reserves "
            f"{sum(fixed.values()) / 2**30:.1f} GiB > {gpu_memory_utilization} x {mem / 2**30:.1f} GiB")
    split = kv_split or {m: 1.0 for m in archs}
    if set(split) != set(archs) or any(v < 0 for v in split.values()) or sum(split.values()) <= 0:
        raise ValueError(f"kv_split must give every model of {sorted(archs)} a weight >= 0, got {split}")
    total = sum(split.values())
    return {m: (fixed[m] + left * split[m] / total) / mem for m in archs}


def fit_report(archs: dict[str, str], hardware: str, shares: dict[str, float],
               min_tokens: dict[str, int] | None = None) -> dict[str, dict]:
    """Per model: ``share``, ``kv_tokens``, ``min_kv_tokens`` and ``fits`` (KV >= the minimum)."""
    out = {}
    for m, a in archs.items():
        need = (min_tokens or {}).get(m, min_kv_tokens(a))
        tok = kv_tokens(a, hardware, shares[m])
        out[m] = {"share": shares[m], "kv_tokens": tok, "min_kv_tokens": need, "fits": tok >= need}
    return out


def switch_seconds(arch: str, hardware: str, host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S,
                   switch_overhead_s: float = 0.0) -> float:
    """Time to bring ``arch``'s weights onto a GPU from host memory: ``W / B_host + overhead``."""
    return weight_bytes(arch, hardware) / host_link_bytes_per_s + switch_overhead_s


# -- the run ----------------------------------------------------------------------------------

@dataclass
class MultiModelResult:
    """What :func:`run` returns: every request's record (``.replica`` = the GPU that served it,
    ``.model`` = the model it asked for) and one ``RunResult`` per (GPU, model) engine."""

    requests: list[RequestRecord]
    engines: list[RunResult]            # placement order: GPU 0's models, then GPU 1's ...
    placement: list[list[str]]
    mode: str
    switches: list[dict] = field(default_factory=list)   # time-slicing: gpu, t, from, to, seconds
    wall_time_s: float = 0.0

    @property
    def steps(self):
        return [s for e in self.engines for s in e.steps]

    def summary(self, slo: dict[str, float] | None = None, trim: float = 0.0) -> dict:
        """``RunResult.summary()``'s keys over all requests, plus ``gpus``, ``gpu_seconds``
        (GPUs x span, first arrival to the last step's end or finish), ``busy_gpu_seconds``
        (time in steps and switches), ``switches`` and ``switch_seconds`` (their count and
        total time) and ``routed`` (requests served by each GPU)."""
        out = summarize(self.requests, self.steps, slo, trim)
        gpus = len(self.placement)
        starts = [r.arrival_time for r in self.requests]
        ends = [s.start_time + s.duration for s in self.steps] + \
               [r.finish_time for r in self.requests if r.finish_time is not None]
        span = (max(ends) - min(starts)) if starts and ends else 0.0
        out["gpus"] = gpus
        out["gpu_seconds"] = gpus * span
        switch_s = float(sum(s["seconds"] for s in self.switches))
        out["busy_gpu_seconds"] = float(sum(s.duration for s in self.steps)) + switch_s
        out["switches"] = len(self.switches)
        out["switch_seconds"] = switch_s
        out["routed"] = [sum(1 for r in self.requests if r.replica == g) for g in range(gpus)]
        return out


class _Slot:
    """One model's engine on one GPU."""

    def __init__(self, index: int, gpu: "_GPU", model: str, engine: LLMEngine):
        self.rep = Replica(index, engine, model)     # a router's view, routing bookkeeping, steps
        self.gpu = gpu
        self.model = model

    @property
    def engine(self) -> LLMEngine:
        return self.rep.engine

    def has_work(self) -> bool:
        return self.rep.next_event_time() < float("inf")


class _GPU:
    """The slots of one GPU and the rule that decides which of them runs next."""

    def __init__(self, index: int, mode: str, max_slice_s: float, switch_s: dict[str, float]):
        self.index, self.mode = index, mode
        self.slots: list[_Slot] = []
        self.free_at = 0.0                  # when the step (or switch) in flight ends
        self.turn = 0                       # partition: round-robin position
        self.max_slice_s = max_slice_s
        self.switch_s = switch_s            # model -> seconds to load it
        self.resident: _Slot | None = None  # time_slice: the model whose weights are on the GPU
        self.loaded_at = 0.0
        self.loading: _Slot | None = None   # the model being loaded, until free_at
        self.draining = False               # the resident model takes no new requests
        self.held: dict[str, deque] = {}    # model -> (spec, request id) not handed to its engine yet
        self.switches: list[dict] = []

    # -- time-slicing -------------------------------------------------------------------
    def slot_of(self, model: str) -> _Slot:
        return next(s for s in self.slots if s.model == model)

    def others_waiting(self) -> bool:
        return any(q for m, q in self.held.items() if m != self.resident.model)

    def accepting(self, slot: _Slot) -> bool:
        """May a request for ``slot`` go to its engine now (rather than wait in ``held``)?"""
        if self.mode == "partition":
            return True
        return self.loading is None and slot is self.resident and not self.draining

    def update_drain(self, now: float) -> None:
        """Time-slicing: the resident model starts draining once another model waits and it has
        held the GPU for ``max_slice_s``."""
        if (self.mode == "time_slice" and self.loading is None and not self.draining
                and self.others_waiting() and now - self.loaded_at >= self.max_slice_s - _EPS):
            self.draining = True

    def next_event(self) -> float:
        """When this GPU next acts: its next step, the end of a switch, or ``inf`` (idle)."""
        inf = float("inf")
        if self.mode == "partition":
            ready = [s.rep.next_event_time() for s in self.slots if s.has_work()]
            return max(self.free_at, min(ready)) if ready else inf
        if self.loading is not None:
            return self.free_at
        if self.resident.has_work():
            return max(self.free_at, self.resident.rep.next_event_time())
        return self.free_at if any(self.held.values()) else inf

    def held_count(self, model: str) -> int:
        return len(self.held.get(model, ()))

    # -- the next action ----------------------------------------------------------------
    def act(self, t: float, hand_over) -> None:
        """The GPU's next action at ``t`` (``next_event()``): one model's step, or a switch that
        starts or ends. ``hand_over(slot, spec, rid, now)`` gives a held request to an engine."""
        if self.mode == "partition":
            self._step(self._next_in_turn(t), t)
        elif self.loading is not None:                 # the new model's weights are in: it serves
            self.resident, self.loading = self.loading, None
            self.loaded_at, self.draining = t, False
            self._take_held(self.resident, t, hand_over)
            self.update_drain(t)
        elif self.resident.has_work():
            self.update_drain(t)
            self._step(self.resident, t)
            self.update_drain(self.free_at)
        elif self.others_waiting():                    # the resident model is idle (or drained)
            self._start_switch(self._next_model(), t)
        else:
            self.draining = False
            self._take_held(self.resident, t, hand_over)

    def _next_in_turn(self, t: float) -> _Slot:
        """Partition: the next model in round-robin order that has a step due at ``t``."""
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self.turn + k) % n]
            if slot.has_work() and slot.rep.next_event_time() <= t + _EPS:
                self.turn = (self.turn + k + 1) % n
                return slot
        raise RuntimeError(f"GPU {self.index} has no model ready at {t}")

    def _next_model(self) -> _Slot:
        """Time-slicing: the model whose oldest held request arrived first."""
        waiting = [(q[0][0].arrival_time, m) for m, q in self.held.items() if q and m != self.resident.model]
        return self.slot_of(min(waiting)[1])

    def _start_switch(self, target: _Slot, t: float) -> None:
        seconds = self.switch_s[target.model]
        self.switches.append({"gpu": self.index, "t": t, "from": self.resident.model, "to": target.model,
                              "seconds": seconds})
        self.loading = target
        self.free_at = t + seconds
        target.engine.clock.advance_to(self.free_at)

    def _step(self, slot: _Slot, t: float) -> None:
        slot.engine.clock.advance_to(t)
        slot.rep.step()
        self.free_at = slot.engine.clock.now()

    def _take_held(self, slot: _Slot, t: float, hand_over) -> None:
        q = self.held[slot.model]
        while q:
            spec, rid = q.popleft()
            hand_over(slot, spec, rid, t)


@with_fewer_gc_passes
def run(workload, placement, mode: str = "partition", hardware: str = "a100-80g", *,
        models: dict[str, str] | None = None, shares: dict[str, float] | None = None,
        router="least_requests", router_kwargs: dict | None = None, max_slice_s: float = 5.0,
        host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S, switch_overhead_s: float = 0.0,
        min_kv: dict[str, int] | None = None, gpu_memory_utilization: float = 0.9,
        **engine_kwargs) -> MultiModelResult:
    """Replay ``workload`` on the GPUs of ``placement`` (one list of served model names per GPU),
    sharing each GPU by ``mode`` (module docstring), in the simulator (``executor="sim"``).

    ``models`` maps a served name to the architecture the simulator knows (two fine-tunes of
    one base: ``{"chat": "llama-2-7b", "code": "llama-2-7b"}``); a name not in it is its own
    architecture. ``shares`` (``mode="partition"``): fraction of a GPU's memory per model, the
    same on every GPU (default :func:`partition_shares`, equal KV parts; a GPU with one model
    gets ``gpu_memory_utilization``). Every share and every time-sliced model must fit
    (KV >= ``min_kv[m]``, default one ``max_model_len`` request), else ``ValueError``.
    ``engine_kwargs`` go to every engine's ``EngineConfig``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    placement = [list(g) for g in placement]
    if not placement or any(not g or len(set(g)) != len(g) for g in placement):
        raise ValueError("placement needs at least one GPU, each with one or more distinct models")
    if max_slice_s <= 0 or host_link_bytes_per_s <= 0 or switch_overhead_s < 0:
        raise ValueError("max_slice_s and host_link_bytes_per_s must be > 0, switch_overhead_s >= 0")
    wall0 = time.perf_counter()
    names = list(dict.fromkeys(m for g in placement for m in g))
    archs = {m: (models or {}).get(m, m) for m in names}
    need = {m: (min_kv or {}).get(m, min_kv_tokens(a)) for m, a in archs.items()}
    switch_s = {m: switch_seconds(a, hardware, host_link_bytes_per_s, switch_overhead_s)
                for m, a in archs.items()}

    def share_on(gpu_models: list[str]) -> dict[str, float]:
        if mode == "time_slice" or len(gpu_models) == 1:
            return {m: gpu_memory_utilization for m in gpu_models}
        if shares is not None:
            if sum(shares[m] for m in gpu_models) > 1.0 + 1e-9:
                raise ValueError(f"shares of {gpu_models} add up to more than the whole GPU: {shares}")
            return {m: shares[m] for m in gpu_models}
        return partition_shares({m: archs[m] for m in gpu_models}, hardware, gpu_memory_utilization)

    gpus: list[_GPU] = []
    slots: list[_Slot] = []
    for g, gpu_models in enumerate(placement):
        gpu = _GPU(g, mode, max_slice_s, switch_s)
        got = share_on(gpu_models)
        report = fit_report({m: archs[m] for m in gpu_models}, hardware, got, need)
        bad = {m: r for m, r in report.items() if not r["fits"]}
        if bad:
            raise ValueError(f"GPU {g} ({hardware}, {mode}): " + "; ".join(
                f"{m} holds {r['kv_tokens']} KV tokens in {r['share']:.2f} of the memory, needs {r['min_kv_tokens']}"
                for m, r in bad.items()))
        for m in gpu_models:
            cfg = EngineConfig.from_kwargs(executor="sim", model=archs[m], hardware=hardware,
                                           gpu_memory_utilization=got[m], **engine_kwargs)
            slot = _Slot(len(slots), gpu, m, LLMEngine(cfg, clock="virtual"))
            gpu.slots.append(slot)
            slots.append(slot)
        if mode == "time_slice":
            gpu.resident = gpu.slots[0]
            gpu.held = {m: deque() for m in gpu_models}
        gpus.append(gpu)
    rt = _routers.get(router, **(router_kwargs or {}))
    by_model: dict[str, list[_Slot]] = {}
    for s in slots:
        by_model.setdefault(s.model, []).append(s)

    ref = slots[0].engine
    specs = _prepare_workload(workload, ref, ref.config.seed)
    if rt.uses_prompt_tokens and any(s.prompt_token_ids is None for s in specs):
        from minibatch.workload import Workload
        specs = list(Workload(specs).materialize(32000, seed=ref.config.seed))
    specs = sorted(specs, key=lambda s: s.arrival_time)
    t_first = specs[0].arrival_time if specs else 0.0
    for gpu in gpus:
        gpu.free_at = gpu.loaded_at = t_first
    for s in slots:
        s.engine.clock.advance_to(t_first)

    order: list[tuple[str, _Slot | None]] = []
    unserved: dict[str, RequestRecord] = {}

    def hand_over(slot: _Slot, spec, rid: str, now: float) -> None:
        """Give a request to ``slot``'s engine at ``now`` (its arrival time is kept)."""
        engine = slot.engine
        engine.clock.advance_to(now)          # an idle engine waits for the request; a busy one is past it
        prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else [0] * spec.prompt_len
        params = SamplingParams(temperature=0.0, max_tokens=max(1, spec.max_tokens), ignore_eos=True)
        queued = True
        try:
            engine.add_request(prompt, params, request_id=rid, arrival_time=spec.arrival_time,
                               priority=spec.priority, tenant=spec.tenant)
        except ValueError as e:
            engine.requests[rid] = engine.reject(prompt, params, str(e), request_id=rid,
                                                 arrival_time=spec.arrival_time)
            queued = False
        slot.rep.admitted(rid, len(prompt), now, queued)

    def route(spec, now: float) -> None:
        rid = spec.request_id if spec.request_id is not None else f"r{len(order)}"
        candidates = slots if spec.model is None else by_model.get(spec.model, [])
        if not candidates:
            unserved[rid] = RequestRecord(
                rid, now, spec.prompt_len, 0, spec.priority, spec.tenant, finish_time=now,
                finish_reason="rejected", model=spec.model,
                error=f"no GPU serves model {spec.model!r}; the placement serves {sorted(by_model)}")
            order.append((rid, None))
            return
        views = []
        for s in candidates:
            v = s.rep.view(now, spec.prompt_token_ids)
            held = s.gpu.held_count(s.model)
            if held:
                v = dataclasses.replace(v, num_waiting=v.num_waiting + held)
            views.append(v)
        pos = rt.choose(spec, views, now)
        if not isinstance(pos, int) or not 0 <= pos < len(candidates):
            raise ValueError(f"router {rt.name!r} chose {pos!r}; expected a position in 0..{len(candidates) - 1}")
        slot = candidates[pos]
        gpu = slot.gpu
        if gpu.next_event() == float("inf"):
            gpu.free_at = max(gpu.free_at, now)           # an idle GPU starts with this request
        order.append((rid, slot))
        if gpu.accepting(slot):
            hand_over(slot, spec, rid, now)
        else:
            gpu.held[slot.model].append((spec, rid))
            gpu.update_drain(now)

    pending = deque(specs)
    inf = float("inf")
    while True:
        gpu = min(gpus, key=lambda g: (g.next_event(), g.index))
        t_gpu = gpu.next_event()
        if pending and pending[0].arrival_time <= t_gpu + _EPS:
            spec = pending.popleft()
            route(spec, spec.arrival_time)
            continue
        if t_gpu == inf:
            stuck = [s for s in slots if s.engine.has_unfinished_requests()]
            if stuck:
                raise RuntimeError(f"GPU {stuck[0].gpu.index}: model {stuck[0].model} holds requests and "
                                   "nothing is due (a policy that never schedules them?)")
            break
        gpu.act(t_gpu, hand_over)

    records: list[RequestRecord] = []
    per_slot: dict[int, list[RequestRecord]] = {s.rep.index: [] for s in slots}
    for i, (rid, slot) in enumerate(order):
        if slot is None:
            rec = unserved[rid]
        else:
            rec = RequestRecord.of(slot.engine.requests[rid], keep_tokens=False)
            rec.replica = slot.gpu.index
            rec.model = specs[i].model
            per_slot[slot.rep.index].append(rec)
        records.append(rec)
    wall = time.perf_counter() - wall0
    results = [RunResult(per_slot[s.rep.index], list(s.engine.steps), s.engine.config.to_dict(), [],
                         s.engine.kv.num_blocks, wall, extra={"model": s.model, "gpu": s.gpu.index,
                                                              "arch": archs[s.model]})
               for s in slots]
    switches = sorted((x for g in gpus for x in g.switches), key=lambda x: (x["t"], x["gpu"]))
    return MultiModelResult(records, results, placement, mode, switches, wall)
