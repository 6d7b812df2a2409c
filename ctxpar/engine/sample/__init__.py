"""Sampling: from a step's logits to the tokens it gives, on rank 0.

``step_sampler.StepSampler`` is what the engine calls: it owns the order
(grammar masks, then draft verification, then sampling) and the requests'
RNG states across a step that may fail. Below it, each piece on its own:
sampler.py (logits processing, greedy and random draws, logprobs),
rejection.py (verifying speculative drafts), prompt_logprobs.py (which rows
return every position's logits and the prompt logprobs they give), and
structured outputs: grammar.py (xgrammar: compile, match, mask),
grammar_cache.py (its bounded cache), structured_output.py (requests held
until their grammar is compiled). Nothing here schedules or runs a step.
"""
