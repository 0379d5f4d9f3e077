"""structural_tag (SGLang's sampling param, xgrammar structural tags) on the tiny fp32 Llama: free
text outside the triggers, the schema inside each triggered structure, invalid tags refused."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}
# SGLang's (legacy) format: a structure starts when its trigger appears in the output
TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
       "triggers": ["<"]}
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def test_text_without_a_trigger_is_free(tiny_engine):
    free = tiny_engine.generate("Hello, my name", GREEDY)
    assert "<" not in free["text"]          # the tiny model never writes the trigger by itself
    tagged = tiny_engine.generate("Hello, my name", {**GREEDY, "structural_tag": json.dumps(TAG)})
    assert tagged["output_ids"] == free["output_ids"]


@pytest.mark.parametrize("fmt", ["legacy", "xgrammar"])
def test_the_schema_holds_inside_each_triggered_structure(tiny_engine, fmt):
    tag = TAG if fmt == "legacy" else {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<"],
        "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA},
                  "end": "</f>"}]}}
    lt = tiny_engine.tokenizer.convert_tokens_to_ids("<")
    # a bias on "<" makes the model write the trigger; after it the grammar dictates the structure
    sps = [{"temperature": 1.0, "max_new_tokens": 60, "ignore_eos": True, "sampling_seed": seed,
            "structural_tag": tag, "logit_bias": {lt: 30.0}} for seed in range(8)]
    outs = tiny_engine.generate(["Hello, my name"] * len(sps), sps)
    complete = 0
    for out in outs:
        text = out["text"]
        assert text.startswith("<f>"), text
        for m in re.finditer(r"<f>(.*?)</f>", text, re.S):
            jsonschema.validate(json.loads(m.group(1)), SCHEMA)
            complete += 1
        rest = re.sub(r"<f>(.*?)</f>", "", text, flags=re.S)
        # what is left: at most the last structure, cut by max_new_tokens
        assert re.fullmatch(r"(<(f(>[^<]*(</?f?)?)?)?)?", rest, re.S), text
    assert complete >= 1


def test_structural_tag_given_as_a_dict(tiny_engine):
    out = tiny_engine.generate("Hello, my name", {**GREEDY, "structural_tag": TAG})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


@pytest.mark.parametrize("bad, match", [
    ("{", "structural_tag is not valid JSON"),
    ("[1]", "invalid structural_tag: a JSON object is needed"),
    (json.dumps({"type": "structural_tag"}), 'invalid structural_tag: it needs "structures"'),
    (json.dumps({**TAG, "triggers": ["<x"]}), "invalid structural_tag: .*does not match any trigger"),
    (json.dumps({**TAG, "structures": [{"begin": "<f>", "end": "</f>", "schema": {"type": "nope"}}]}),
     "invalid structural_tag"),
    (json.dumps({"type": "structural_tag", "format": {"type": "bogus"}}), "invalid structural_tag"),
])
def test_invalid_structural_tag_is_refused_and_the_engine_keeps_serving(tiny_engine, bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(["Hi", "Hello"], [GREEDY, {**GREEDY, "structural_tag": bad}])
    assert tiny_engine.generate("Hi", {**GREEDY, "max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_structural_tag_excludes_the_other_grammars(tiny_engine):
    for other in ({"regex": "a+"}, {"json_schema": "{}"}, {"ebnf": 'root ::= "a"'}):
        with pytest.raises(ValueError, match="only one of json_schema, regex, ebnf, structural_tag"):
            tiny_engine.generate("Hi", {**GREEDY, "structural_tag": json.dumps(TAG), **other})
