"""Multi-LoRA serving: many low-rank adapters on one base model, batched in one step.

A LoRA adapter (Hu et al., arXiv:2106.09685) changes a projection ``y = x W^T`` into::

    y = x W^T + scale * (x A^T) B^T,     A: [r, in], B: [out, r], scale = lora_alpha / r

so a request with adapter X computes what a model whose weights were merged,
``W + scale * B @ A``, computes, without a copy of the model per adapter. Requests with
different adapters share one step: the base GEMM runs once over every row, and each
adapter adds its two thin GEMMs to its own rows (Punica, arXiv:2310.18547, does this in
one kernel, SGMV, over segments of rows; here one pair of torch GEMMs per adapter in the
step, the same arithmetic).

As in vLLM (``--enable-lora``, ``max_loras``, ``max_lora_rank``), the device holds
``max_loras`` adapter *slots*: weight buffers padded to ``max_lora_rank``. The scheduler
lets at most ``max_loras`` distinct adapters into one step (:func:`lora_id`,
``Scheduler._build``); before the step runs, :class:`AdapterSlots` loads each adapter the
step needs and is not in a slot into a free slot or the least recently used one whose
adapter is not in the step. Loading copies the adapter's weights in (host -> device on a
GPU), which costs time: measured here on CPU, modelled in the simulator
(``minibatch.sim.lora``). Adapters are read once, when the first request naming them
arrives (PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``), and kept on
the host (vLLM's ``max_cpu_loras`` bounds that cache; here it is unbounded).

Targets: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` (PEFT's names);
``lora_dropout`` is irrelevant at inference; ``use_rslora`` (scale ``alpha / sqrt(r)``) is
honoured; DoRA and bias-training adapters are refused with an error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# minibatch fuses q/k/v and gate/up into one projection each: which fused projection a
# PEFT module adds to, and in what order the parts are concatenated.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(mc) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each target module of a model config."""
    q, kv, h, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    """One adapter's weights: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``).

    ``lora_int_id`` (>= 1) identifies the adapter to the scheduler and the slots; give the
    weights either as ``lora_path`` (a PEFT directory) or as an in-memory ``adapter``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | None = None
    adapter: LoRAAdapter | None = field(default=None, compare=False, repr=False)


def lora_id(req) -> int:
    """The adapter id a request runs with; 0 for the base model."""
    lr = getattr(req, "lora_request", None)
    return lr.lora_int_id if lr is not None else 0


# -- adapters on disk -----------------------------------------------------------------------------------
def read_peft(path: str | Path, mc, name: str = "adapter") -> LoRAAdapter:
    """Read a PEFT LoRA directory for a model of config ``mc``; ``ValueError`` naming what is wrong."""
    path = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({str(path)!r})"
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{where} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: adapters that train biases (bias={cfg.get('bias')!r}) are not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: adapter_config.json needs a positive integer r, got {rank!r}")
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{where} has no adapter_model.safetensors")
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights_file))
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{where}: cannot read adapter_model.safetensors ({type(e).__name__}: {e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"{where}: unexpected weight {key!r}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        halves.setdefault((layer, module), {})[ab] = t.float()
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        weights[(layer, module)] = (ab["A"], ab["B"])
    adapter = LoRAAdapter(rank, float(alpha), weights, bool(cfg.get("use_rslora", False)))
    check_adapter(adapter, mc, where)
    return adapter


def check_adapter(adapter: LoRAAdapter, mc, where: str = "LoRA adapter") -> None:
    """Shapes, layers and modules fit the model; ``ValueError`` naming the first that does not."""
    shapes = module_shapes(mc)
    if not adapter.weights:
        raise ValueError(f"{where} has no LoRA weights")
    for (layer, module), (a, b) in adapter.weights.items():
        if module not in shapes:
            raise ValueError(f"{where}: target module {module!r} is not supported; expected some of "
                             f"{TARGET_MODULES}")
        if not 0 <= layer < mc.num_layers:
            raise ValueError(f"{where}: layer {layer} is outside the model's {mc.num_layers} layers")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (adapter.rank, fan_in) or tuple(b.shape) != (fan_out, adapter.rank):
            raise ValueError(f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model needs {(adapter.rank, fan_in)} and "
                             f"{(fan_out, adapter.rank)} (rank {adapter.rank})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{where}: layer {layer} {module} has non-finite weights")


def save_peft(adapter: LoRAAdapter, path: str | Path) -> Path:
    """Write ``adapter`` as a PEFT directory (what :func:`read_peft` reads)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    modules = sorted({m for _, m in adapter.weights}, key=TARGET_MODULES.index)
    cfg = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.alpha, "target_modules": modules,
           "bias": "none", "lora_dropout": 0.0, "use_rslora": adapter.use_rslora, "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    state = {}
    for (layer, module), (a, b) in adapter.weights.items():
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
        state[f"{prefix}.lora_A.weight"] = a.contiguous()
        state[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(state, str(path / "adapter_model.safetensors"))
    return path


def random_adapter(mc, rank: int = 8, seed: int = 0, alpha: float | None = None, std: float = 0.05,
                   targets: tuple[str, ...] = TARGET_MODULES) -> LoRAAdapter:
    """A seeded random adapter (A and B both non-zero, unlike a freshly initialised PEFT one)."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(mc)
    weights = {}
    for layer in range(mc.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            weights[(layer, module)] = (torch.randn(rank, fan_in, generator=g) * std,
                                        torch.randn(fan_out, rank, generator=g) * std)
    return LoRAAdapter(rank, float(rank if alpha is None else alpha), weights)


def merge_into_hf_state(state: dict[str, torch.Tensor], adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
    """A copy of a Hugging Face state dict with ``W + scale * B @ A`` for every adapted module."""
    out = dict(state)
    for (layer, module), (a, b) in adapter.weights.items():
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"model.layers.{layer}.{part}.{module}.weight"
        out[key] = state[key] + adapter.scale * (b.double() @ a.double()).to(state[key].dtype)
    return out


def resolve(lora_request: LoRARequest, mc, max_lora_rank: int) -> LoRAAdapter:
    """The adapter a request names, checked against the model and ``max_lora_rank``."""
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    lid, name = lora_request.lora_int_id, lora_request.lora_name
    if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
        raise ValueError(f"LoRA adapter {name!r}: lora_int_id must be an integer >= 1, got {lid!r}")
    if (lora_request.lora_path is None) == (lora_request.adapter is None):
        raise ValueError(f"LoRA adapter {name!r}: give exactly one of lora_path and adapter")
    if lora_request.adapter is not None:
        adapter = lora_request.adapter
        check_adapter(adapter, mc, f"LoRA adapter {name!r}")
    else:
        adapter = read_peft(lora_request.lora_path, mc, name)
    if adapter.rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank} but max_lora_rank is {max_lora_rank}")
    return adapter


# -- slots --------------------------------------------------------------------------------------------
class AdapterSlots:
    """Which adapter sits in which of ``max_loras`` slots; LRU among those a step does not need.

    ``activate(ids)`` makes every id of a step resident and returns the ids it loaded.
    """

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}          # adapter id -> slot
        self.last_used: dict[int, int] = {}        # adapter id -> step counter of its last use
        self.step = 0
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def loaded(self) -> frozenset[int]:
        return frozenset(self.slot_of)

    def activate(self, ids) -> list[tuple[int, int]]:
        """Make ``ids`` (adapter ids, 0 = base excluded) resident; returns ``[(id, slot)]`` loaded."""
        ids = {i for i in ids if i}
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step needs {len(ids)} adapters but there are {self.max_loras} slots "
                               f"(max_loras); the scheduler should not have built it")
        self.step += 1
        loaded = []
        for lid in sorted(ids):
            if lid not in self.slot_of:
                free = set(range(self.max_loras)) - set(self.slot_of.values())
                if free:
                    slot = min(free)
                else:   # evict the least recently used adapter this step does not need
                    victim = min((i for i in self.slot_of if i not in ids), key=lambda i: (self.last_used[i], i))
                    slot = self.slot_of.pop(victim)
                    self.last_used.pop(victim)
                    self.num_evictions += 1
                self.slot_of[lid] = slot
                self.num_loads += 1
                loaded.append((lid, slot))
            self.last_used[lid] = self.step
        return loaded


class _Hook:
    """Set on a layer's Attention and MLP: adds the step's LoRA deltas to a projection's output."""

    __slots__ = ("slots", "layer")

    def __init__(self, slots: "LoRASlots", layer: int):
        self.slots, self.layer = slots, layer

    def __call__(self, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        groups = self.slots.groups
        if groups is None:
            return
        a_stack, b_stack = self.slots.buffers[self.layer][proj]
        for slot, rows in groups:
            if rows is None:                           # every row of the step uses this adapter
                out += (x @ a_stack[slot].T) @ b_stack[slot].T
            else:
                out[rows] += (x[rows] @ a_stack[slot].T) @ b_stack[slot].T


class LoRASlots(AdapterSlots):
    """Device buffers of ``max_loras`` adapters for a model, and the hooks that use them.

    Per layer and fused projection: ``A [max_loras, parts * max_lora_rank, in]`` and
    ``B [max_loras, out, parts * max_lora_rank]``, B block-diagonal over the fused parts
    (q/k/v, gate/up) and already multiplied by the adapter's scale; a module an adapter
    does not target, or ranks below ``max_lora_rank``, stay zero.
    """

    def __init__(self, model, mc, max_loras: int, max_lora_rank: int):
        super().__init__(max_loras)
        self.mc = mc
        self.max_lora_rank = max_lora_rank
        w = model.embed_tokens.weight
        shapes = module_shapes(mc)
        R = max_lora_rank
        self.buffers = []
        for layer in model.layers:
            per = {}
            for proj, parts in FUSED.items():
                fan_in = shapes[parts[0]][0]
                fan_out = sum(shapes[p][1] for p in parts)
                per[proj] = (torch.zeros(max_loras, len(parts) * R, fan_in, dtype=w.dtype, device=w.device),
                             torch.zeros(max_loras, fan_out, len(parts) * R, dtype=w.dtype, device=w.device))
            self.buffers.append(per)
            layer.self_attn.lora = _Hook(self, len(self.buffers) - 1)
            layer.mlp.lora = layer.self_attn.lora
        self.adapters: dict[int, LoRAAdapter] = {}      # host copies, by id
        self.names: dict[int, str] = {}
        self.groups: list[tuple[int, torch.Tensor | None]] | None = None
        self.load_seconds = 0.0
        model.lora_slots = self

    def register(self, lora_request: LoRARequest) -> None:
        """Read and check a request's adapter once (``ValueError`` on a bad one)."""
        lid = getattr(lora_request, "lora_int_id", None)
        if lid in self.adapters and isinstance(lora_request, LoRARequest):
            if self.names[lid] != lora_request.lora_name:
                raise ValueError(f"lora_int_id {lid} is already adapter {self.names[lid]!r}, not "
                                 f"{lora_request.lora_name!r}")
            return
        adapter = resolve(lora_request, self.mc, self.max_lora_rank)
        self.adapters[lid] = adapter
        self.names[lid] = lora_request.lora_name

    def _copy_in(self, lid: int, slot: int) -> None:
        adapter, R, r = self.adapters[lid], self.max_lora_rank, self.adapters[lid].rank
        shapes = module_shapes(self.mc)
        with torch.no_grad():
            for layer, per in enumerate(self.buffers):
                for proj, parts in FUSED.items():
                    a_buf, b_buf = per[proj]
                    a_buf[slot].zero_()
                    b_buf[slot].zero_()
                    row = 0
                    for k, module in enumerate(parts):
                        fan_out = shapes[module][1]
                        pair = adapter.weights.get((layer, module))
                        if pair is not None:
                            a, b = pair
                            a_buf[slot, k * R:k * R + r] = a
                            b_buf[slot, row:row + fan_out, k * R:k * R + r] = b * adapter.scale
                        row += fan_out

    def begin_step(self, token_ids_per_row: list[int]) -> None:
        """Load the step's adapters into slots and group the flat batch's rows by slot."""
        import time

        ids = set(token_ids_per_row) - {0}
        if not ids:
            self.groups = None
            return
        t0 = time.perf_counter()
        for lid, slot in self.activate(ids):
            self._copy_in(lid, slot)
        self.load_seconds += time.perf_counter() - t0
        if len(ids) == 1 and 0 not in token_ids_per_row:
            self.groups = [(self.slot_of[next(iter(ids))], None)]
            return
        rows = torch.tensor(token_ids_per_row)
        device = self.buffers[0]["o"][0].device
        self.groups = [(self.slot_of[lid], torch.nonzero(rows == lid).flatten().to(device)) for lid in sorted(ids)]

    def end_step(self) -> None:
        self.groups = None


def adapter_view(engine) -> dict:
    """What a router sees of an engine's adapters (``ReplicaView`` fields; vLLM's
    ``vllm:lora_requests_info`` gauge): the adapter names of its running and waiting requests,
    and ``max_loras`` (0 when LoRA is off)."""
    c = engine.config
    if not c.enable_lora:
        return {}
    sched = engine.scheduler
    running = frozenset(r.lora_request.lora_name for r in sched.running if r.lora_request is not None)
    waiting = frozenset(r.lora_request.lora_name for r in sched.waiting if r.lora_request is not None)
    return {"running_adapters": running, "waiting_adapters": waiting, "max_loras": c.max_loras}
