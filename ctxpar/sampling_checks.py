"""SamplingParams' checks of its list and dict fields (stop strings, token ids,
logit_bias, structured outputs); a bad value raises a CtxparError naming the
field, the value and what is allowed. The range checks of its numbers are
ctxpar/checks.py's.

Every list has a bound on its length (and a list of strings on its characters in
all): what a request carries is worked on at every step of every one of its samples
(stop strings against the new text, bad words and token ids against the logits), so
an unbounded list lets one request slow every step for everyone. The bounds are at
least vLLM's where it has one (its model runner's 128 stop token ids, 1024 allowed
token ids, 1024 logit_bias entries), and far above what a client uses elsewhere
(OpenAI takes 4 stop strings).
"""

from __future__ import annotations

from ctxpar.checks import check_float, is_int
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams

# (most items, most characters in all) of the lists of strings.
MAX_STOP = (1024, 16384)
MAX_BAD_WORDS = (256, 8192)
# Most items of the lists of token ids, and of logit_bias.
MAX_TOKEN_IDS = {"stop_token_ids": 1024, "allowed_token_ids": 4096}
MAX_LOGIT_BIAS = 1024


def strings(name: str, value: object, bound: tuple[int, int]) -> list[str]:
    """A str, a list of non-empty str or None, as a list, within ``bound`` (items, characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise CtxparError(f"{name} must be a string, a list of strings or None, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise CtxparError(f"{name} must hold non-empty strings, got {s!r} in {name}={value!r}")
    most, most_chars = bound
    if len(items) > most:
        raise CtxparError(f"{name} has {len(items)} strings: at most {most} are allowed")
    chars = sum(len(s) for s in items)
    if chars > most_chars:
        raise CtxparError(f"{name} has {chars} characters in all: at most {most_chars} are allowed")
    return items


def token_ids(name: str, value: object, empty_ok: bool) -> list[int]:
    """A list of token ids (integers >= 0), or None when ``empty_ok`` (as [])."""
    if value is None and empty_ok:
        return []
    if not isinstance(value, (list, tuple)) or (not value and not empty_ok):
        what = "a list of integers >= 0" + (" or None" if empty_ok else " with at least one id")
        raise CtxparError(f"{name} must be {what}, got {value!r}")
    if len(value) > MAX_TOKEN_IDS[name]:
        raise CtxparError(f"{name} has {len(value)} token ids: at most {MAX_TOKEN_IDS[name]} are allowed")
    for t in value:
        if not is_int(t) or t < 0:
            raise CtxparError(f"{name} must be integers >= 0, got {t!r} in {name}={value!r}")
    return list(value)


def check_logit_bias(logit_bias: object) -> None:
    """None, or {token_id: bias} with biases in [-1e9, 1e9]."""
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise CtxparError(f"logit_bias must be a dict {{token_id: bias}} or None, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise CtxparError(f"logit_bias has {len(logit_bias)} entries: at most {MAX_LOGIT_BIAS} are allowed")
    for t, b in logit_bias.items():
        if not is_int(t) or t < 0:
            raise CtxparError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
        check_float(f"logit_bias[{t}]", b, -1e9, 1e9)


def check_structured_outputs(so: object, min_tokens: int, allowed_token_ids: list[int] | None) -> None:
    """None, or a valid StructuredOutputsParams that the request's other fields leave satisfiable."""
    if so is None:
        return
    if not isinstance(so, StructuredOutputsParams):
        raise CtxparError(f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got {so!r}")
    so.validate()
    # Both could leave no token allowed: the grammar may allow only EOS where
    # min_tokens bans it, or only tokens outside allowed_token_ids.
    if min_tokens:
        raise CtxparError(
            "min_tokens cannot be combined with structured_outputs (the grammar decides where the output "
            "ends): drop min_tokens"
        )
    if allowed_token_ids is not None:
        raise CtxparError(
            "allowed_token_ids cannot be combined with structured_outputs (the grammar decides which "
            "tokens are allowed): drop allowed_token_ids"
        )
