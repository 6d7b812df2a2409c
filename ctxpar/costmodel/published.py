"""Published measurements the cost model is checked against.

Meta's context-parallelism paper (Yang et al., "Context Parallelism for Scalable
Million-Token Inference", arXiv 2411.01783): Llama3-405B, FP8 row-wise weights,
one CP rank = a node of 8 H100 SXM in TP8 over NVLink, nodes joined by 400 Gb/s
per GPU RDMA, batch 1, full prefill (no cached tokens), ring pass-KV.

NVIDIA's NIM benchmarks (NIM LLM Benchmarking, "Performance",
https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance.md):
Llama-3.3-70B-Instruct (Llama-3-70B's shapes), NIM 1.8.0 (TensorRT-LLM), 2 x H100
80G, FP8, TP2, measured by AIPerf at concurrency 1 (one request at a time, so
batch 1): TTFT of the prompt and ITL, the mean time between streamed tokens
(a decode step at the prompt's length plus the tokens generated so far).
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


@dataclass(frozen=True)
class PublishedStep:
    """One published latency of a step: a prefill of ``prompt`` tokens (``kind``
    "ttft"), or a decode step (``kind`` "itl") averaged over ``output`` tokens
    generated after it, so at a mean context of prompt + output / 2."""

    model: str  # a built-in model of ctxpar estimate
    hardware: str  # a built-in profile
    kind: str  # "ttft" or "itl"
    prompt: int
    output: int
    seconds: float
    source: str
    fitted: bool = False  # a profile constant was fitted to this row: not a prediction

    @property
    def context(self) -> int:
        """The decode step's mean context (ITL), or the prompt (TTFT)."""
        return self.prompt + self.output // 2 if self.kind == "itl" else self.prompt


NIM = (
    "NVIDIA NIM LLM Benchmarking, Performance: Llama-3.3-70b-instruct, NIM 1.8.0, 2 x H100 80G, fp8 TP2, concurrency 1"
)
NIM_LLAMA_70B_TP2 = (
    PublishedStep("llama-3-70b", "h100x2-nvlink", "ttft", 5000, 500, 0.40677, NIM, fitted=True),
    PublishedStep("llama-3-70b", "h100x2-nvlink", "itl", 5000, 500, 0.01858, NIM),
    PublishedStep("llama-3-70b", "h100x2-nvlink", "ttft", 500, 2000, 0.04777, NIM),
    PublishedStep("llama-3-70b", "h100x2-nvlink", "itl", 500, 2000, 0.01891, NIM),
)
