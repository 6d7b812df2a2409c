"""A request's side of the prefix cache (block_manager.py holds the blocks and their
hashes): the hash chain of its full blocks, the cached blocks its known tokens start
with, and the offer of the blocks it has computed."""

from __future__ import annotations

from ctxpar.engine.block_manager import BlockManager, extend_block_hashes
from ctxpar.engine.request import Request


def cached_prefix(block_manager: BlockManager, req: Request) -> list[int]:
    """Cached blocks holding the longest prefix of the request's known
    tokens, all but the last: that one is computed so the request samples."""
    if not block_manager.enable_caching or req.skip_prefix_cache:
        return []
    n = (req.num_tokens - 1) // block_manager.block_size
    return block_manager.cached_prefix(_block_hashes(block_manager, req, n)[:n])


def cache_computed(block_manager: BlockManager, req: Request) -> None:
    """Offer the request's computed full blocks to the prefix cache.

    The scheduler calls it lazily, at the next schedule() and before the request's
    blocks are freed (finished: after its last step ran; aborted or preempted: between
    steps). num_computed_tokens counts only tokens a completed step wrote
    (commit), never those of a step planned or failed, so a registered
    block always holds real KV; a hash pointing at KV never written would
    give a later request wrong tokens.
    """
    if block_manager.enable_caching:
        n = req.num_computed_tokens // block_manager.block_size
        block_manager.cache_blocks(req.request_id, _block_hashes(block_manager, req, n), n)


def _block_hashes(block_manager: BlockManager, req: Request, num_blocks: int) -> list[bytes]:
    """The request's hash chain, grown to cover at least its first
    ``num_blocks`` full blocks (every block is hashed once per request); salted
    with the request's cache_salt, so only requests of the same salt share blocks."""
    bs = block_manager.block_size
    if len(req.block_hashes) < num_blocks:
        tokens = req.token_ids(len(req.block_hashes) * bs, num_blocks * bs)
        extend_block_hashes(req.block_hashes, tokens, bs, req.params.cache_salt)
    return req.block_hashes
