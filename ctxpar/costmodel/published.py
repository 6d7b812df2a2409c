"""Published measurements the cost model is checked against.

Meta's context-parallelism paper (Yang et al., "Context Parallelism for Scalable
Million-Token Inference", arXiv 2411.01783): Llama3-405B, FP8 row-wise weights,
one CP rank = a node of 8 H100 SXM in TP8 over NVLink, nodes joined by 400 Gb/s
per GPU RDMA, batch 1, full prefill (no cached tokens), ring pass-KV.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedTTFT:
    context: int
    pcp: int  # CP ranks (nodes of 8 GPUs)
    ttft_s: float


META_MODEL, META_HARDWARE = "llama-3-405b", "h100x8-ib"
K = 1024
META_CP_TTFT = (
    PublishedTTFT(8 * K, 1, 1.74),
    PublishedTTFT(8 * K, 2, 1.00),
    PublishedTTFT(32 * K, 1, 7.66),
    PublishedTTFT(32 * K, 2, 4.02),
    PublishedTTFT(128 * K, 1, 42.0),
    PublishedTTFT(128 * K, 2, 21.0),
    PublishedTTFT(128 * K, 4, 10.95),
    PublishedTTFT(128 * K, 8, 5.85),
    PublishedTTFT(128 * K, 16, 3.8),
    PublishedTTFT(1 << 20, 16, 77.0),
)
# Pass-Q beats pass-KV below about this KV-cache miss rate (new / (new + cached)) at CP4, 128K.
META_PASS_Q_CROSSOVER = (128 * K, 4, 0.05)
