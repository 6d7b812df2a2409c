"""RunnerOptions: what a ModelRunner needs of the engine's configuration, as one
frozen object built from EngineConfig (the same on every rank)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ctxpar.checks import usable_cores
from ctxpar.config import EngineConfig
from ctxpar.costmodel.policy import PCPPolicy, derive_policy
from ctxpar.costmodel.profiles import engine_hardware
from ctxpar.costmodel.shapes import shape_of
from ctxpar.device import torch_dtype
from ctxpar.model_args import ModelArgs


@dataclass(frozen=True)
class RunnerOptions:
    """num_blocks, block_size: the paged cache (per rank; under DCP a block
    table's logical block is block_size * dcp_size tokens). dtype: the cache's,
    unless kv_cache_dtype quantizes it (ctxpar/layers/kv_quant.py).

    pcp_min_tokens: prefill rows shorter than this are not split.

    policy: the PCP policy the thresholds came from (ctxpar/costmodel/policy.py), which
    also picks, per step, the ranks each split row goes over; None: all of them.

    dcp_size: 1 (every rank holds the whole KV cache) or the group's size (each
    holds the shard of ctxpar.parallel.dcp_shard), with cp_interleave.

    spread_min_rows: unsplit rows (decodes, short prompts) go to one rank each
    in steps that split a row or have at least this many of them
    (ctxpar/parallel/pcp_spread.py); None: always replicated. Never under DCP,
    where a decode's queries must be on every rank (each attends its own shard).

    lead_threads: for ranks that share one host's cores (and hold the whole
    cache): a step that splits no row is *led*, computed by rank 0 alone with
    this many threads (the ranks' together, at most the host's cores), which sends the new KV to the
    others. Their unsplit rows are then assigned only beside a split row. None:
    such steps replicate or assign as above.
    """

    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "model"  # EngineConfig.kv_cache_dtype (resolved): the cache's storage
    pcp_min_tokens: int = 0
    dcp_size: int = 1
    cp_interleave: int = 1
    spread_min_rows: int | None = None
    lead_threads: int | None = None
    policy: PCPPolicy | None = None
    enforce_eager: bool = False  # EngineConfig.enforce_eager: no compiled decode loop, no CUDA graphs
    max_num_seqs: int = 64  # EngineConfig.max_num_seqs: the largest decode step a graph is captured for
    max_model_len: int | None = None  # EngineConfig.max_model_len: the longest context (None: the cache's)

    def __post_init__(self) -> None:
        if self.dcp_size > 1:
            object.__setattr__(self, "spread_min_rows", None)
            object.__setattr__(self, "lead_threads", None)
        if self.lead_threads is not None:
            object.__setattr__(self, "spread_min_rows", sys.maxsize)  # led steps take what spreading would

    @classmethod
    def from_config(
        cls, config: EngineConfig, num_blocks: int, hf_config: ModelArgs, one_host: bool = False
    ) -> RunnerOptions:
        """hf_config: the model's (its shapes size the PCP policy); one_host: the ranks
        share one host's cores (they lead unsplit steps)."""
        threads = config.threads_per_rank()
        policy = pcp_policy(config, hf_config, one_host) if config.pcp_size > 1 else None
        return cls(
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=torch_dtype(config.dtype),
            kv_cache_dtype=config.kv_cache_dtype,
            pcp_min_tokens=policy.min_tokens if policy is not None else 0,
            dcp_size=config.dcp_size,
            cp_interleave=config.cp_interleave,
            spread_min_rows=policy.spread_min_rows if policy is not None else None,
            lead_threads=_lead_threads(threads, config.pcp_size) if one_host and threads is not None else None,
            policy=policy,
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
        )


def _lead_threads(threads: int, pcp_size: int) -> int | None:
    """Ranks sharing a host's cores: steps without a split row run on rank 0 with all the
    ranks' threads, but no more than the host's cores (P ranks on fewer cores would spin
    threads against each other), and never fewer than the rank's own."""
    return min(threads * pcp_size, max(threads, usable_cores())) if pcp_size > 1 else None


def pcp_policy(config: EngineConfig, hf_config: ModelArgs, one_host: bool) -> PCPPolicy:
    """The PCP policy of P > 1 ranks: the thresholds config leaves None derived from the
    cost model for the model's shapes, P, D and the hardware profile. Every rank derives
    the same one from the same config and profile."""
    return derive_policy(
        shape_of(hf_config, "the model"),
        engine_hardware(config.hardware_profile, one_host).with_kv_cache_dtype(config.kv_cache_dtype),
        config.pcp_size,
        config.dcp_size,
        config.pcp_min_tokens,
        config.pcp_spread_min_rows,
        config.pcp_split_mode,
    )
