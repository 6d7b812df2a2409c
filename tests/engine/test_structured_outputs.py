"""Structured outputs on the real SmolLM2: every output validates (jsonschema), choices
and regexes fullmatch, logprobs are of the constrained distribution, and bad grammars
fail alone. A sampler that skipped the mask fails every check here: the model's
free text is not JSON."""

from __future__ import annotations

import json
import math
import re

import pytest
from pydantic import BaseModel, Field

from ctxpar import LLM
from ctxpar.engine.sample.grammar_cache import GrammarCache
from ctxpar.errors import CtxparError
from ctxpar.sampling_params import SamplingParams, StructuredOutputsParams
from helpers.structured import SCHEMAS, check_json

SETTINGS = [(0.0, None), (1.0, 0), (1.0, 1), (1.0, 2)]  # greedy, and sampling with three seeds


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", quantization="none") as llm:
        yield llm


def json_params(schema, temperature=0.0, seed=None, max_tokens=150, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=schema),
        **kw,
    )


@pytest.fixture(scope="module")
def batch(llm):
    """Every schema at every setting, in one batch: [(schema name, params, output)]."""
    cases = [(name, json_params(s, t, seed)) for name, s in SCHEMAS.items() for t, seed in SETTINGS]
    outs = llm.generate([f"Reply with a JSON {name}:" for name, _ in cases], [p for _, p in cases], use_tqdm=False)
    return [(name, p, o.outputs[0]) for (name, p), o in zip(cases, outs)]


def test_every_output_validates_against_its_schema(batch):
    for name, _, out in batch:
        assert out.finish_reason == "stop", (name, out.text)
        check_json(out.text, SCHEMAS[name])


def test_seeded_output_is_the_same_alone_as_in_a_batch(llm, batch):
    name, params, out = batch[6]  # a sampled (seeded) request
    assert params.seed is not None
    [alone] = llm.generate([f"Reply with a JSON {name}:"], params, use_tqdm=False)
    assert alone.outputs[0].token_ids == out.token_ids


def test_choice_and_regex_fullmatch(llm):
    choices = ["Paris", "London", "Rome, Italy"]
    regex = r"[A-Z][a-z]{2,5}-\d{2,4}"
    params = [
        SamplingParams(temperature=t, seed=seed, max_tokens=30, structured_outputs=so)
        for so in (StructuredOutputsParams(choice=choices), StructuredOutputsParams(regex=regex))
        for t, seed in SETTINGS
    ]
    outs = llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    for o in outs[: len(SETTINGS)]:
        assert o.outputs[0].text in choices
    for o in outs[len(SETTINGS) :]:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text


def test_json_object_grammar_and_pydantic_schema(llm):
    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=99_999_999)
        coastal: bool

    params = [
        SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=City)),
    ]
    obj, city = llm.generate(["Describe Paris as JSON:"] * 2, params, use_tqdm=False)
    assert isinstance(json.loads(obj.outputs[0].text), (dict, list))
    City.model_validate_json(city.outputs[0].text)


def test_grammar_ebnf(llm):
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    [out] = llm.generate(["What is 6 times 7?"], params, use_tqdm=False)
    assert re.fullmatch(r"The answer is [0-9]+\.", out.outputs[0].text)


def test_logprobs_are_of_the_constrained_distribution(llm):
    """Only tokens that start a choice have finite logprobs, and they sum to one."""
    tok = llm.get_tokenizer()
    choices = ["yes", "no"]
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    [unconstrained] = llm.generate(["Is the sky blue? Answer:"], free, use_tqdm=False)
    constrained = SamplingParams(
        temperature=0, max_tokens=1, logprobs=20, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    [out] = llm.generate(["Is the sky blue? Answer:"], constrained, use_tqdm=False)
    first = out.outputs[0].logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if math.isfinite(lp.logprob)}
    assert finite and all(any(c.startswith(tok.decode([t])) for c in choices) for t in finite)
    assert math.isclose(sum(math.exp(v) for v in finite.values()), 1.0, rel_tol=1e-4)
    # Renormalised over fewer tokens: no allowed token is less likely than without the grammar.
    free_lp = unconstrained.outputs[0].logprobs[0]
    for t, v in finite.items():
        if t in free_lp:
            assert v >= free_lp[t].logprob


def test_n_samples_length_stop_and_ignore_eos(llm):
    schema = SCHEMAS["array"]
    many = json_params(schema, 1.0, 7, n=3)
    short = SamplingParams(
        max_tokens=3, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"])
    )
    stop = json_params(schema, stop=[","])
    no_eos = json_params(schema, ignore_eos=True)
    outs = llm.generate(["Reply with a JSON array:"] * 4, [many, short, stop, no_eos], use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        check_json(c.text, schema)
    assert outs[1].outputs[0].finish_reason == "length"  # an unfinished structure, cut by max_tokens
    assert outs[2].outputs[0].finish_reason == "stop" and outs[2].outputs[0].stop_reason == ","
    # The grammar ends the output even when EOS is ignored: nothing may follow a complete value.
    check_json(outs[3].outputs[0].text, schema)
    assert outs[3].outputs[0].finish_reason == "stop"


def test_same_schema_compiles_once(llm):
    engine = llm.llm_engine.engine
    schema = SCHEMAS["ref"]
    reordered = json.loads(json.dumps(dict(reversed(list(schema.items())))))
    llm.generate(["x"] * 2, [json_params(schema), json_params(reordered)], use_tqdm=False)
    keys = [k for k in engine.structured.backend.cache if k[0] == "json" and "$defs" in k[1]]
    assert len(keys) == 1


@pytest.mark.parametrize(
    "so, words",
    [
        (dict(json={"type": "foo"}), "Unsupported type"),
        (dict(json={"$ref": "#/$defs/missing"}), "missing"),
        (dict(regex="a(b"), "parenthesis"),
        (dict(grammar='root ::= "a" |'), "EBNF"),
        (dict(grammar='start ::= "a"'), "root"),
    ],
)
def test_bad_grammar_fails_alone(llm, so, words):
    engine = llm.llm_engine
    good = json_params(SCHEMAS["array"])
    [want] = llm.generate(["Reply with a JSON array:"], good, use_tqdm=False)
    engine.add_request("good", "Reply with a JSON array:", good)
    with pytest.raises(CtxparError, match=words):
        engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(), "exactly one"),
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
        (dict(choice=[]), "non-empty list"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json=[1, 2]), "must be a dict"),
        (dict(json_object=False), "True"),
        (dict(regex="a", whitespace_pattern=" "), "disable_any_whitespace"),
    ],
)
def test_bad_params_name_the_problem(kw, words):
    with pytest.raises(CtxparError, match=words):
        StructuredOutputsParams(**kw)


def test_refused_combinations():
    so = StructuredOutputsParams(choice=["a"])
    with pytest.raises(CtxparError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=so)
    with pytest.raises(CtxparError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=so)


def test_compact_json_and_closed_objects(llm):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": True,
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)
    [out] = llm.generate(
        ["JSON please:"], SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=so), use_tqdm=False
    )
    value = json.loads(out.outputs[0].text)
    assert out.outputs[0].text == json.dumps(value)  # one space after ',' and ':', none elsewhere
    assert list(value) == ["a"]


def test_chat_with_tools_offline(llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    so = StructuredOutputsParams(json=tools[0]["function"]["parameters"])
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    [out] = llm.chat([{"role": "user", "content": "Weather in Paris?"}], params, tools=tools, use_tqdm=False)
    check_json(out.outputs[0].text, tools[0]["function"]["parameters"])


def test_failed_step_and_preemption_leave_the_grammars_in_step(llm):
    """A step that raises advances no matcher, and a preempted request (its KV
    dropped and recomputed) keeps its place in its grammar: the outputs are those
    of an undisturbed run."""
    names = ["nested", "ref"] * 3
    prompts = [f"Reply with a JSON {name}:" for name in names]
    # At most 48 tokens: a prompt and its output fit the small engine's max_model_len below,
    # so a sample that has not closed its JSON by then ends where the undisturbed one does.
    params = [json_params(SCHEMAS[name], 1.0, seed, max_tokens=48) for seed, name in enumerate(names)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    executor = llm.llm_engine.engine.executor
    real, calls = executor.execute, []

    def execute(plan):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("step failed")
        return real(plan)

    executor.execute = execute
    engine = llm.llm_engine
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except RuntimeError:
                continue
            got |= {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    finally:
        executor.execute = real
    assert [got[str(i)] for i in range(len(prompts))] == want and len(calls) > 5
    # A KV cache that holds about one request at a time: the others are preempted and recomputed.
    with LLM(
        dtype="float32", quantization="none", kv_cache_bytes=3 << 20, max_model_len=64, enable_prefix_caching=False
    ) as small:
        small.generate(prompts, params, use_tqdm=False)  # compiles the grammars: all start together next
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.llm_engine.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_structural_tags(llm):
    """xgrammar's format (here: the whole output one tag around a schema) and vLLM's
    legacy one (free text; a trigger starts a tagged, schema-checked part)."""
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}
    tag = {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}
    current = {"type": "structural_tag", "format": tag}
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    params = [
        SamplingParams(
            temperature=1.0, seed=2, max_tokens=40, structured_outputs=StructuredOutputsParams(structural_tag=st)
        )
        for st in (current, json.dumps(legacy))
    ]
    whole, free = llm.generate(["Call f:", "Call f: <f>"], params, use_tqdm=False)
    m = re.fullmatch(r"<f>(.*)</f>", whole.outputs[0].text, re.S)
    assert m, whole.outputs[0].text
    check_json(m.group(1), schema)
    for part in re.findall(r"<f>(.*?)</f>", free.outputs[0].text, re.S):
        check_json(part, schema)


def test_a_compile_slower_than_a_step_wait_is_waited_for(llm):
    """A compile that takes longer than a step's wait for grammars (a loaded machine) is
    waited for: the request is queued once its grammar is compiled, and served."""
    import time

    backend = llm.engine.structured.backend
    worker = backend.worker

    class Slow:
        def compile(self, spec, timeout):
            time.sleep(0.5)  # ten times the step's wait
            return worker.compile(spec, timeout)

    backend.worker, backend.cache = Slow(), GrammarCache()
    try:
        [out] = llm.generate(
            ["Pick one:"],
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["slow", "fast"])),
            use_tqdm=False,
        )
    finally:
        backend.worker = worker
    assert out.outputs[0].text in ("slow", "fast")
