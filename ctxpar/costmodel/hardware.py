"""What one context-parallel rank is, as the cost model needs it.

A rank may be one CPU process, one GPU, or a whole node running tensor
parallelism inside (Meta's setup: a rank = 8 H100 in TP8 over NVLink). Rates are
per rank: peaks times efficiency factors give the rates the model uses, so a
profile measured by ``ctxpar calibrate`` carries achieved rates and efficiency 1.

Communication between CP ranks follows the alpha-beta model: a collective step
costs ``link_latency_s + bytes / (link_bandwidth * link_efficiency)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ctxpar.config import KV_CACHE_DTYPES
from ctxpar.costmodel.rates import DTYPE_BYTES, Rates, rates_from_notes
from ctxpar.costmodel.shapes import ModelShape
from ctxpar.errors import CtxparError

# Latencies one all-reduce among ``ranks`` (> 1) ranks pays, by algorithm (fixed_costs.py).
ALLREDUCE_HOPS = {
    "ring": lambda ranks: 2 * (ranks - 1),
    "tree": lambda ranks: 2 * math.ceil(math.log2(ranks)),
    "one-shot": lambda ranks: 1,
}

# The weight dtypes `ctxpar calibrate` measures projections in, each with the activation
# dtype its projections take: q4 (GGUF's Q4_0 blocks, on a CPU) takes fp32 rows, which its
# kernel rounds to int8 itself, as the engine runs a Q4_0 file by default.
CALIBRATED_WEIGHT_DTYPES = {"fp32": "fp32", "bf16": "bf16", "q4": "fp32"}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gemm_flops: float  # peak FLOP/s per rank of GEMMs in the weight dtype
    attention_flops: float  # peak FLOP/s per rank of attention (activation dtype)
    memory_bandwidth: float  # bytes/s per rank (HBM or DRAM)
    memory_bytes: float  # capacity per rank
    link_bandwidth: float  # bytes/s per rank, one direction, between CP ranks
    link_latency_s: float  # per collective step between CP ranks
    weight_dtype: str = "bf16"
    activation_dtype: str = "bf16"  # KV cache, queries, activations exchanged
    # The KV cache's dtype (EngineConfig.kv_cache_dtype): "auto" (a profile's own) and
    # "model" (an engine's, resolved) store the activation dtype; int8 / fp8 store a byte
    # a value and a scale per head (ModelShape.kv_bytes).
    kv_cache_dtype: str = "auto"
    gemm_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    link_efficiency: float = 1.0
    # Bytes/s at which the linear layers read their weights at a decode step's one row,
    # as ``ctxpar calibrate`` measures the engine's own projection path (a GEMV kernel may
    # stream weights slower than a plain read): used for every weight read of the linear
    # layers. 0 (built-in profiles, profiles saved before it existed): the memory rate,
    # memory_bandwidth x memory_efficiency.
    weight_read_bandwidth: float = 0.0
    # Bytes/s at which a decode step reads its KV cache, as ``ctxpar calibrate`` measures the
    # engine's paged decode kernel over a cache of the activation dtype (its per-key work makes
    # it slower than a plain read): used for a decode step's KV read where the cache stores the
    # activations as they are ("auto"). 0 (built-in profiles, profiles saved before it existed,
    # a GPU, where that kernel does not run): the memory rate, as for a quantized cache.
    kv_read_bandwidth: float = 0.0
    # Bytes/s at which a step's elementwise steps move their values (ModelShape.elementwise_bytes:
    # RMSNorms, residual adds, rope, SiLU·up, the KV cache's write), as ``ctxpar calibrate``
    # measures the engine's own kernels for them at a prefill's rows in the activation dtype.
    # 0 (built-in profiles, profiles saved before it existed): not counted (a GPU fuses and
    # hides them; the published fits were made without them).
    elementwise_bandwidth: float = 0.0
    # Fraction of a ring step's transfer that runs under that step's attention
    # (1: a GPU's copy engines overlap them; 0: a blocking collective, as ctxpar's on CPU).
    comm_overlap: float = 0.0
    # Fixed cost of each ring step of pass-KV / pass-Q per layer: a partial attention's
    # launch and its LSE merge (measured as the gap between P ranks and 1/P of one).
    ring_step_overhead_s: float = 0.0
    # The host's cost of a forward step beyond its kernels' work (framework, launches,
    # the engine's Python): once a step, and once a layer (ctxpar/entrypoints/cli/calibrate_host.py).
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    # Fixed cost of one row's attention in one layer (its kernel call, its context's slots):
    # what laying a step out in more, smaller rows costs (ctxpar/costmodel/policy.py).
    row_overhead_s: float = 0.0
    # Kernel launches (ctxpar/costmodel/fixed_costs.py): a layer of a forward step launches
    # kernels_per_layer kernels, each costing the host kernel_launch_s beyond layer_overhead_s.
    # async_launch: the device runs them while the host queues more (a GPU), so only the host
    # time beyond the device's work shows; else (a CPU) the host's time adds up.
    kernels_per_layer: int = 0
    kernel_launch_s: float = 0.0
    async_launch: bool = False
    # Decode steps replayed from CUDA graphs: one replay (graph_replay_s of the host) instead
    # of the launches, and graph_kernel_s of the device between each two kernels.
    decode_graphs: bool = False
    graph_replay_s: float = 0.0
    graph_kernel_s: float = 0.0
    tp_size: int = 1  # tensor-parallel devices inside one rank
    tp_bandwidth: float = 0.0  # bytes/s per device for the TP all-reduces
    tp_latency_s: float = 0.0  # per hop of a TP all-reduce
    # How a TP all-reduce is done, which sets its hops (ALLREDUCE_HOPS): "ring"
    # (NCCL's ring), "tree", or "one-shot" (each device reads the others' shares over
    # NVLink at once, as vLLM's and TensorRT-LLM's custom all-reduce do for small messages).
    tp_allreduce: str = "ring"
    usable_memory_fraction: float = 0.9  # the rest: activations, workspace, fragmentation
    # Every rate `ctxpar calibrate` measured, by dtype and width (ctxpar/costmodel/rates.py):
    # where with_weight_dtype, with_activation_dtype and for_model take theirs.
    rates: Rates = field(default_factory=Rates)
    # The calibration's other measurements (threads, each link's fit), kept for the record:
    # nothing is priced from them.
    notes: dict[str, float] = field(default_factory=dict)
    # Ranks sharing one host's cores (ctxpar's shared-memory channel between them) run a
    # step that splits no prompt on rank 0 alone with every rank's threads, a *led* step
    # (ctxpar/worker/options.py): this is that host's rank with all of them, as `ctxpar
    # calibrate --link shm` measures it. None: a rank per host, or not measured.
    lead: HardwareProfile | None = None

    def __post_init__(self) -> None:
        positive = ("gemm_flops", "attention_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth")
        for name in positive:
            _check(self.name, name, getattr(self, name), 0.0, math.inf, open_lo=True)
        nonnegative = (
            "link_latency_s",
            "weight_read_bandwidth",
            "kv_read_bandwidth",
            "elementwise_bandwidth",
            "ring_step_overhead_s",
            "step_overhead_s",
            "layer_overhead_s",
            "row_overhead_s",
            "kernel_launch_s",
            "graph_replay_s",
            "graph_kernel_s",
            "tp_latency_s",
        )
        for name in (*nonnegative, "tp_bandwidth"):
            _check(self.name, name, getattr(self, name), 0.0, math.inf)
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "link_efficiency"):
            _check(self.name, name, getattr(self, name), 0.0, 1.0, open_lo=True)
        _check(self.name, "comm_overlap", self.comm_overlap, 0.0, 1.0)
        _check(self.name, "usable_memory_fraction", self.usable_memory_fraction, 0.0, 1.0, open_lo=True)
        for name in ("weight_dtype", "activation_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise CtxparError(f"hardware {self.name}: {name} must be one of {', '.join(DTYPE_BYTES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise CtxparError(f"hardware {self.name}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if not isinstance(self.kernels_per_layer, int) or self.kernels_per_layer < 0:
            raise CtxparError(f"hardware {self.name}: kernels_per_layer must be an integer >= 0")
        if self.tp_allreduce not in ALLREDUCE_HOPS:
            raise CtxparError(f"hardware {self.name}: tp_allreduce must be one of {', '.join(ALLREDUCE_HOPS)}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise CtxparError(f"hardware {self.name}: tp_size must be an integer >= 1, got {self.tp_size!r}")
        if self.tp_size > 1 and self.tp_bandwidth <= 0:
            raise CtxparError(f"hardware {self.name}: tp_size > 1 needs tp_bandwidth > 0")
        if not isinstance(self.rates, Rates):
            raise CtxparError(f"hardware {self.name}: rates must be a Rates record, got {type(self.rates).__name__}")
        if self.lead is not None and (not isinstance(self.lead, HardwareProfile) or self.lead.lead is not None):
            raise CtxparError(f"hardware {self.name}: lead must be a profile without a lead of its own")

    def led(self, leads: bool) -> HardwareProfile:
        """The profile a step runs at: the host's with every rank's threads where the
        step is led (``leads``) and the profile has it, else this rank's."""
        return self.lead if leads and self.lead is not None else self

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> HardwareProfile:
        """This profile (and its lead) with the KV cache stored as ``kv_cache_dtype``."""
        lead = self.lead.with_kv_cache_dtype(kv_cache_dtype) if self.lead is not None else None
        return replace(self, kv_cache_dtype=kv_cache_dtype, lead=lead)

    def with_weight_dtype(self, weight_dtype: str) -> HardwareProfile:
        """This profile (and its lead) with weights stored as ``weight_dtype``: its GEMM and
        weight-read rates are those `ctxpar calibrate` measured for that dtype (``rates``: one
        calibration serves every weight dtype); the activations, attention and memory stay as
        they are."""
        if weight_dtype == self.weight_dtype:
            return self
        gemm, read = self.rates.get("gemm_flops", weight_dtype), self.rates.get("weight_read_bandwidth", weight_dtype)
        if gemm is None or read is None:
            measured = self.rates.dtypes("gemm_flops")
            raise CtxparError(
                f"hardware {self.name} has no rates for {weight_dtype} weights (measured: "
                f"{', '.join(measured) or 'none'}); `ctxpar calibrate` measures {', '.join(CALIBRATED_WEIGHT_DTYPES)}"
            )
        lead = self.lead.with_weight_dtype(weight_dtype) if self.lead is not None else None
        return replace(
            self, weight_dtype=weight_dtype, gemm_flops=gemm, weight_read_bandwidth=read, gemm_efficiency=1.0, lead=lead
        )

    def with_activation_dtype(self, activation_dtype: str) -> HardwareProfile:
        """This profile (and its lead) computing in ``activation_dtype`` (fp32 or bf16: the
        engine's ``--dtype``, its KV cache's dtype where "auto"): the attention, KV read and
        elementwise rates `ctxpar calibrate` measured in that dtype (``rates``; bf16 attention on
        AMX's tiles where the CPU has them) and the host's cost of a step and of a layer in it,
        where measured; the weights stay as they are."""
        if activation_dtype == self.activation_dtype:
            return self
        rates, dtype = self.rates, activation_dtype
        attention = rates.get("attention_flops", dtype)
        if attention is None:
            measured = rates.dtypes("attention_flops")
            raise CtxparError(
                f"hardware {self.name} has no attention rate for {activation_dtype} activations (measured: "
                f"{', '.join(measured) or 'none'}); `ctxpar calibrate` measures fp32 and bf16"
            )
        lead = self.lead.with_activation_dtype(activation_dtype) if self.lead is not None else None
        return replace(
            self,
            activation_dtype=activation_dtype,
            attention_flops=attention,
            attention_efficiency=1.0,
            kv_read_bandwidth=rates.get("kv_read_bandwidth", dtype) or 0.0,
            elementwise_bandwidth=rates.get("elementwise_bandwidth", dtype) or 0.0,
            step_overhead_s=_or(rates.get("step_overhead_s", dtype), self.step_overhead_s),
            layer_overhead_s=_or(rates.get("layer_overhead_s", dtype), self.layer_overhead_s),
            lead=lead,
        )

    def for_model(self, m: ModelShape) -> HardwareProfile:
        """This profile (and its lead) at the rates `ctxpar calibrate` measured over the layer
        whose hidden size is nearest ``m``'s (``rates`` by width): its weights read (a decode
        projection reads long rows faster than short ones, so a 4096-wide layer's rate prices an
        8B model, a 2048-wide one's a 1B) and its projections' GEMM in the weight dtype, and its
        elementwise steps in the activation dtype. Each rate unchanged where none of its kind
        was measured by width."""
        lead = self.lead.for_model(m) if self.lead is not None else None
        hidden, weights, activations = m.hidden_size, self.weight_dtype, self.activation_dtype
        nearest = {
            "weight_read_bandwidth": self.rates.nearest("weight_read_bandwidth", weights, hidden),
            "gemm_flops": self.rates.nearest("gemm_flops", weights, hidden),
            "elementwise_bandwidth": self.rates.nearest("elementwise_bandwidth", activations, hidden),
        }
        changed: dict[str, Any] = {field: rate for field, rate in nearest.items() if rate is not None}
        if "gemm_flops" in changed:
            changed["gemm_efficiency"] = 1.0
        return replace(self, lead=lead, **changed)

    def kv_token_bytes(self, m: ModelShape) -> float:
        """Bytes of one token's KV entry in one layer's cache."""
        return m.kv_bytes(self.kv_cache_dtype, self.act_bytes)

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def act_bytes(self) -> float:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def memory_rate(self) -> float:
        """Bytes/s of plain memory traffic (a prefill's KV reads; a decode step's where
        ``kv_read_rate`` has no measured rate): peak x efficiency."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def weight_read_rate(self) -> float:
        """Bytes/s at which the linear layers read weights: the measured projection rate
        where the profile has one, else the memory rate."""
        return self.weight_read_bandwidth or self.memory_rate

    @property
    def kv_read_rate(self) -> float:
        """Bytes/s at which a decode step reads its KV cache: the paged decode kernel's
        measured rate where the profile has one for this cache (the activation dtype's,
        "auto"), else the memory rate."""
        measured = self.kv_read_bandwidth if self.kv_cache_dtype in ("auto", "model") else 0.0
        return measured or self.memory_rate

    def link_time(self, nbytes: float, steps: int = 1) -> float:
        """Seconds for ``steps`` collective steps moving ``nbytes`` in all (alpha-beta)."""
        return steps * self.link_latency_s + nbytes / (self.link_bandwidth * self.link_efficiency)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def _or(measured: float | None, otherwise: float) -> float:
    """``measured`` where there is one (0 included), else ``otherwise``."""
    return otherwise if measured is None else measured


def _check(profile: str, name: str, value: object, lo: float, hi: float, open_lo: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (open_lo and value == lo) or value > hi:  # type: ignore[operator]
        bound = f"> {lo}" if open_lo else f">= {lo}"
        upper = "" if hi == math.inf else f" and <= {hi}"
        raise CtxparError(f"hardware {profile}: {name} must be a number {bound}{upper}, got {value!r}")


def profile_from_dict(data: dict[str, Any], origin: str) -> HardwareProfile:
    """The profile of ``data`` (a JSON object as ``to_json`` writes it). A profile saved with
    its rates as notes (``gemm_flops_q4``, ``elementwise_bandwidth_fp32_hidden2048``: before
    ``rates`` existed) loads with those notes as its rates."""
    if not isinstance(data, dict):
        raise CtxparError(f"hardware profile {origin}: expected a JSON object")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CtxparError(f"hardware profile {origin}: unknown field(s) {', '.join(unknown)}")
    if isinstance(data.get("lead"), dict):
        data = data | {"lead": profile_from_dict(data["lead"], f"{origin} (lead)")}
    try:
        if isinstance(data.get("rates"), dict):
            data = data | {"rates": Rates(**data["rates"])}
        elif "rates" not in data and isinstance(data.get("notes"), dict):
            rates, notes = rates_from_notes(data["notes"])
            data = data | {"rates": rates, "notes": notes}
    except (TypeError, CtxparError) as e:  # a rate's field misspelt or missing, an unknown kind
        raise CtxparError(f"hardware profile {origin}: {e}") from None
    try:
        return HardwareProfile(**data)
    except TypeError as e:  # a required field missing
        raise CtxparError(f"hardware profile {origin}: {e}") from None
