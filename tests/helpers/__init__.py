"""Helpers shared by the test modules; conftest.py keeps only the fixtures.

``tests/`` is on sys.path (pyproject: pythonpath = ["tests"]), so a test imports
``from helpers.models import save_tiny_model`` whatever folder it is in, and so
can a process it spawns, which inherits that path (multiprocessing spawn) or is
given it (the scripts that tests write for torchrun).

- models: tiny random checkpoints (transformers configs, saved with random weights)
- reference: one sequence through a CausalLM, transformers' greedy generate,
  greedy comparison allowing a near-tie
- deepseek_configs: tiny DeepSeek-V2/V3 configs
- tiny_tokenizer: a byte-level tokenizer for the tiny models
- workloads, step_failures: prompts and sampling mixes several modules share
- attention_reference: float64 attention that ops and kernels are checked against
- pcp_harness, dcp_harness: scripted step plans run on real ranks
- shm_ranks: the rank processes of the shared-memory channel tests
- attack_ranks: a victim rank and an attacker posing as rank 0 (rendezvous security tests)
- server_harness: a real ``ctxpar serve`` process
- procs: a process's mappings of ctxpar's shared files, and the addresses it listens on
"""
