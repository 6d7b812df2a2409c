"""Time of one prefill and of one decode step on one rank, as a roofline with
exposed communication.

Each operation takes max(FLOPs / FLOP rate, bytes / memory rate) and is counted
as compute or memory traffic by whichever bound it; collectives that cannot
hide under attention add their exposed part. Symbols: B requests, T new tokens
each after C cached ones, P PCP ranks, D DCP ranks (D = 1: every rank holds the
whole KV cache; D = P: each holds 1/P of it), L layers, H query heads.

Prefill, per rank (DualChunkSwap gives every rank B*T/P tokens and 1/P of the
causal attention work, sum over new tokens of the keys each sees:
B*(T*C + T*(T+1)/2)):

- linear:    2 * params_per_token * B*T/P FLOPs; reads the weights once, at the
             rate the profile's projections read weights (``weight_read_rate``:
             measured by ``ctxpar calibrate`` through the engine's decode
             projection, else the memory rate)
- attention: 2*H*(d_qk + d_v) FLOPs per (query, key) pair per layer
- elementwise: B*T/P tokens x L layers x the bytes a token moves through a layer's
             RMSNorms, residual adds, rope, SiLU·up and KV-cache write
             (ModelShape.elementwise_bytes), at the rate ``ctxpar calibrate``
             measured those kernels of the engine at (``elementwise_bandwidth``;
             0, the built-in profiles: not counted)
- per layer and algorithm (kv, q, o: bytes per token of KV entries, queries,
  partial outputs with their LSE; X = T + C where the context is sharded
  (D = P), else T):
  gather   all-gather of the others' KV, exposed:
           (P-1) * alpha + (P-1)/P * B*X * kv / BW
  pass-KV  a ring of P-1 steps, each passing B*X/P tokens' KV under 1/P of the
           layer's attention: (P-1) * (max(0, step - overlap * attn/P) + ring_overhead)
  pass-Q   the same ring passing B*T/P queries (D = P only), then an all-to-all
           returning partial outputs: alpha + (P-1)/P * B*T * o / BW

Decode step (B rows at the full context each): every rank reads all weights
(the rows are replicated; at ``weight_read_rate``) and its share of the KV cache
(1/D of it, at ``kv_read_rate``: measured by ``ctxpar calibrate`` through the
engine's paged decode kernel, else the memory rate) and moves its B rows through
the elementwise steps as a prefill's tokens; under DCP each layer ends
with one pairwise all-to-all of the partial outputs and LSEs (D - 1 latencies).

Every step, prefill or decode, also pays the fixed costs of fixed_costs.py: the
host's step and layers (launches included; exposed on a GPU only beyond the
device's work), or with CUDA graphs (decode only) one replay and a gap per
kernel; TP's all-reduces pay their algorithm's hops. Those make a decode step
and a short prefill what they are: the same terms, a different share.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.costmodel.fixed_costs import fixed_s, ring_hops, tp_allreduce_s
from ctxpar.costmodel.hardware import HardwareProfile
from ctxpar.costmodel.shapes import ModelShape

LSE_BYTES = 4  # fp32 log-sum-exp per head and row, exchanged with the partial output


@dataclass(frozen=True)
class Breakdown:
    """Seconds by cause; they add up to the total."""

    compute_s: float = 0.0  # operations bound by FLOPs
    memory_s: float = 0.0  # operations bound by memory traffic
    tp_comm_s: float = 0.0  # tensor-parallel all-reduces inside a rank (a node of GPUs)
    comm_s: float = 0.0  # communication between CP ranks not hidden under compute
    overhead_s: float = 0.0  # fixed costs: ring steps' launches and merges, the framework's step

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.tp_comm_s + self.comm_s + self.overhead_s

    def plus(
        self,
        *,
        compute: float = 0.0,
        memory: float = 0.0,
        tp_comm: float = 0.0,
        comm: float = 0.0,
        overhead: float = 0.0,
    ) -> Breakdown:
        return Breakdown(
            self.compute_s + compute,
            self.memory_s + memory,
            self.tp_comm_s + tp_comm,
            self.comm_s + comm,
            self.overhead_s + overhead,
        )


def _roofline(b: Breakdown, flops: float, flop_rate: float, nbytes: float, byte_rate: float) -> Breakdown:
    """Add one operation: compute-bound or memory-bound, whichever takes longer."""
    compute, memory = flops / flop_rate, nbytes / byte_rate
    return b.plus(compute=compute) if compute >= memory else b.plus(memory=memory)


def _rates(h: HardwareProfile) -> tuple[float, float, float]:
    return h.gemm_flops * h.gemm_efficiency, h.attention_flops * h.attention_efficiency, h.memory_rate


def _elementwise(b: Breakdown, m: ModelShape, h: HardwareProfile, tokens: float) -> Breakdown:
    """Add the elementwise steps of ``tokens`` tokens through every layer (memory traffic at
    the calibrated rate; nothing where the profile has none)."""
    if not h.elementwise_bandwidth:
        return b
    return b.plus(memory=tokens * m.num_layers * m.elementwise_bytes(h.act_bytes) / h.elementwise_bandwidth)


def prefill_time(
    m: ModelShape, h: HardwareProfile, new: int, cached: int, batch: int, pcp: int, dcp: int, algorithm: str
) -> Breakdown:
    """Time to first token: the prefill of ``new`` tokens per request after ``cached`` ones."""
    gemm, attn_rate, mem = _rates(h)
    head = m.vocab_size * m.hidden_size  # the LM head, for each request's last token
    tokens = batch * new / pcp
    b = _roofline(
        Breakdown(),
        2 * m.linear_params_per_token * tokens + 2 * head * batch,
        gemm,
        (m.params_read(tokens) + head) * h.weight_bytes,
        h.weight_read_rate,
    )
    pairs = batch * (new * cached + new * (new + 1) / 2) / pcp
    kv_token = h.kv_token_bytes(m)
    keys_read = batch * (cached + new) / (dcp if algorithm == "pass-Q" else 1)
    before = b.compute_s + b.memory_s
    b = _roofline(
        b,
        pairs * m.attention_flops_per_pair * m.num_layers,
        attn_rate,
        keys_read * kv_token * m.num_layers,
        mem,
    )
    attn_layer = (b.compute_s + b.memory_s - before) / m.num_layers
    b = _elementwise(b, m, h, tokens)
    b = b.plus(tp_comm=tp_allreduce_s(m, h, tokens))
    b = b.plus(overhead=fixed_s(m, h, b.total_s, graphed=False))
    if pcp == 1:
        return b
    sharded = batch * (new + (cached if dcp > 1 else 0))  # tokens whose KV moves
    if algorithm == "gather":
        comm = h.link_time((pcp - 1) / pcp * sharded * kv_token, steps=pcp - 1)
        return b.plus(comm=m.num_layers * comm)
    if algorithm == "pass-KV":
        step = h.link_time(sharded / pcp * kv_token)
        tail = 0.0
    elif algorithm == "pass-Q":
        step = h.link_time(batch * new / pcp * m.num_heads * m.qk_head_dim * h.act_bytes)
        out_token = m.num_heads * (m.v_head_dim * h.act_bytes + LSE_BYTES)
        tail = h.link_time((pcp - 1) / pcp * batch * new * out_token, steps=ring_hops(pcp))
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    exposed = (pcp - 1) * max(0.0, step - h.comm_overlap * attn_layer / pcp) + tail
    return b.plus(comm=m.num_layers * exposed, overhead=m.num_layers * (pcp - 1) * h.ring_step_overhead_s)


def decode_time(m: ModelShape, h: HardwareProfile, context: int, batch: int, dcp: int) -> Breakdown:
    """One decode step of ``batch`` rows, each at ``context`` tokens (its KV cache sharded over ``dcp`` ranks)."""
    gemm, attn_rate, _ = _rates(h)
    head = m.vocab_size * m.hidden_size
    b = _roofline(
        Breakdown(),
        2 * (m.linear_params_per_token + head) * batch,
        gemm,
        (m.params_read(batch) + head) * h.weight_bytes,
        h.weight_read_rate,
    )
    keys = batch * context / dcp
    b = _roofline(
        b,
        keys * m.decode_attention_flops_per_pair * m.num_layers,
        attn_rate,
        keys * h.kv_token_bytes(m) * m.num_layers,
        h.kv_read_rate,
    )
    b = _elementwise(b, m, h, batch)
    b = b.plus(tp_comm=tp_allreduce_s(m, h, batch))
    if dcp > 1:
        out_row = m.num_heads * (m.decode_v_dim * h.act_bytes + LSE_BYTES)
        b = b.plus(comm=m.num_layers * h.link_time((dcp - 1) / dcp * batch * out_row, steps=ring_hops(dcp)))
    return b.plus(overhead=fixed_s(m, h, b.total_s, graphed=h.decode_graphs))


def pass_q_crossover(m: ModelShape, h: HardwareProfile, context: int, pcp: int, batch: int = 1) -> float:
    """The KV-cache miss rate (new tokens / context) below which ring pass-Q is predicted
    faster than ring pass-KV for a prompt of ``context`` tokens whose cached part is sharded
    over ``pcp`` ranks (D = P): the least new / context at which pass-KV is no slower, by
    bisection over whole token counts (pass-Q wins at few new tokens, pass-KV at many).
    1.0 when pass-Q wins at every count."""
    if pcp < 2 or context < 2:
        raise ValueError("a crossover needs at least 2 ranks and 2 tokens")

    def kv_wins(new: int) -> bool:
        cached = context - new
        q = prefill_time(m, h, new, cached, batch, pcp, pcp, "pass-Q").total_s
        return prefill_time(m, h, new, cached, batch, pcp, pcp, "pass-KV").total_s <= q

    lo, hi = 1, context - 1
    if not kv_wins(hi):
        return 1.0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if kv_wins(mid) else (mid + 1, hi)
    return lo / context
