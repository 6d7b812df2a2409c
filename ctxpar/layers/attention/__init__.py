"""Attention over ctxpar's paged KV cache, behind one backend.

- attend.py: ``attend(q, entries, ctx, kind)``, the one entry models call, and
  the attention kinds' protocol (``GQA`` there, MLA in ctxpar/layers/mla.py);
- backend.py: where attention runs, ctxpar's kernels or PyTorch, chosen once
  per rank and carried in the step's ForwardContext; a layer's ``AttentionSpec``;
- paged.py: a step's local rows over a full paged cache, by query kind;
- sharded.py: every query over a cache sharded by DCP, partials merged;
- torch_ops.py: the PyTorch path's ops, and the exact merge of partials.
"""
