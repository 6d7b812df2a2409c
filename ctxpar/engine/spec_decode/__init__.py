"""Speculative decoding on rank 0: draft tokens before a step, verify them after it.

The engine asks ``SpecDecoder.propose`` (decoder.py) for drafts of the requests about to
decode (n-gram lookup, ngram.py; a draft model, draft.py; or a DeepSeek-V3
checkpoint's next-token-prediction layer, mtp.py); the scheduler
turns each drafted request's row into 1 + k tokens (the last known token and
the drafts) with logits at every position; after the step, the sampling floor
keeps the accepted prefix plus one token (engine/sample/rejection.py, given
``draft_probs``), the scheduler appends them and rolls the rejected drafts' KV
back (Scheduler.update_from_output), and ``record`` counts them.
"""

from ctxpar.engine.spec_decode.decoder import SpecDecoder, SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpecDecoder"]
