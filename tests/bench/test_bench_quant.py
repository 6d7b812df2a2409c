"""`ctxpar bench quant` on the real SmolLM2 Q4_1 GGUF, at a size a test affords: the
decode rows of each KV storage, and the perplexity of real English and code
through prompt_logprobs against the float32 cache ("model")."""

from __future__ import annotations

import math
import re

from ctxpar import cli


def test_decode_rows_and_the_kv_caches_perplexity(capsys):
    args = ["bench", "quant", "--setups", "gguf", "--contexts", "16", "--steps", "2", "--repeat", "1"]
    assert cli.main([*args, "--kv-cache-dtypes", "model", "int8", "--perplexity", "96", "--eager"]) in (0, None)
    out = capsys.readouterr().out
    decode = re.findall(r"^\s*gguf \|\s+(\w+) \|\s+16 \|\s+([\d.]+) \|\s+([\d.]+) \|.*\|\s+([\d.]+)$", out, re.M)
    assert [kv for kv, _, _, _ in decode] == ["model", "int8"] and float(decode[0][2]) == 1.0
    # --eager: each step's ratio to the same engine with enforce_eager=True (a ratio, not a timing check).
    assert "x eager" in out and all(0 < float(vs_eager) < math.inf for _, _, _, vs_eager in decode)
    ppl = re.findall(r"^\s*gguf \|\s+(\w+) \|\s+(english|code) \|\s+([\d.]+) \|\s+([\d.]+)$", out, re.M)
    assert sorted((kv, text) for kv, text, _, _ in ppl) == [
        ("int8", "code"),
        ("int8", "english"),
        ("model", "code"),
        ("model", "english"),
    ]
    for kv, _, value, ratio in ppl:
        assert 1 < float(value) < 1000 and math.isfinite(float(value))
        # The baseline's own ratio is 1; int8 codes with a scale per token and head stay close.
        assert float(ratio) == 1.0 if kv == "model" else abs(float(ratio) - 1) < 0.05
