"""Constrained decoding on SmolLM2-135M-Instruct: sampled answers that match their JSON schema, regex or grammar."""

import json
import re
import time

import jsonschema
import pytest
from schemas import PERSON, SCHEMAS

from minimlx import Constraint, batch_generate, generate
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.decode.grammar import guidance_tokenizer
from minimlx.errors import InvalidSettingError
from minimlx.text.tokenizer import Tokenizer


@pytest.mark.slow
def test_sampled_answers_validate_against_their_schemas(smollm2):
    model, tokenizer = smollm2
    for i, schema in enumerate(SCHEMAS):
        for seed in (1, 2):
            answer = generate(
                model,
                tokenizer,
                "Answer in JSON.",
                max_tokens=60,
                temperature=0.8,
                seed=seed + 10 * i,
                constraint=Constraint.json_schema(schema),
            )
            jsonschema.validate(json.loads(answer), schema)


@pytest.mark.slow
def test_strict_closes_objects_and_json_object_is_any_object(smollm2):
    model, tokenizer = smollm2
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict = Constraint.json_schema(open_schema, strict=True)
    assert json.loads(strict.source)["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(Constraint.json_schema(open_schema).source)
    answer = generate(model, tokenizer, "A JSON object:", max_tokens=30, temperature=0.8, seed=3, constraint=strict)
    assert list(json.loads(answer)) == ["a"]
    any_object = generate(
        model, tokenizer, "Describe a cat in JSON.", max_tokens=40, constraint=Constraint.json_object()
    )
    assert any_object.startswith("{") and " " not in any_object.split('"')[0]  # compact: no whitespace before keys


@pytest.mark.slow
def test_regex_lark_and_gbnf_answers_match(smollm2):
    model, tokenizer = smollm2
    for seed in (1, 2, 3):
        phone = generate(
            model, tokenizer, "A phone number:", max_tokens=12, temperature=0.8, seed=seed,
            constraint=Constraint.regex(r"[0-9]{3}-[0-9]{4}"),
        )  # fmt: skip
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), phone
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    answer = generate(model, tokenizer, "Is the sky blue?", max_tokens=12, constraint=Constraint.lark(lark))
    assert answer in ("The answer is yes.", "The answer is no.")
    assert (
        generate(model, tokenizer, "Say a", max_tokens=10, constraint=Constraint.gbnf('root ::= "a"{5,5}')) == "aaaaa"
    )


@pytest.mark.slow
def test_lark_with_a_json_schema_and_a_special_token(smollm2):
    model, tokenizer = smollm2
    grammar = (
        'start: "Data: " data <|im_end|>\ndata: %json {"type": "object", "properties": {"k": {"type": "integer"}}}'
    )
    answer = generate(model, tokenizer, "Some data.", max_tokens=30, constraint=Constraint.lark(grammar))
    assert answer.startswith("Data: ")
    assert isinstance(json.loads(answer[len("Data: ") :]), dict)


@pytest.mark.slow
def test_batch_mixes_constrained_and_free_rows(smollm2):
    model, tokenizer = smollm2
    prompts = ["Give a person as JSON.", "Write a haiku about the sea.", "Name a colour.", "List three primes."]
    constraint = Constraint.json_schema(PERSON)
    own = [{"constraint": constraint}, {}, {"constraint": Constraint.regex("(red|green|blue)")}, {}]
    answers = batch_generate(model, tokenizer, prompts, max_tokens=24, per_prompt=own)
    jsonschema.validate(json.loads(answers[0]), PERSON)
    assert answers[2] in ("red", "green", "blue")
    for i in (1, 3):  # the free rows decode as they do alone
        assert answers[i] == generate(model, tokenizer, prompts[i], max_tokens=24)


@pytest.mark.slow
def test_speculative_rounds_keep_to_the_grammar(smollm2):
    model, tokenizer = smollm2
    constraint = Constraint.json_schema(PERSON)
    for options in ({"prompt_lookup": 3}, {"draft_model": model}):
        for temperature, seed in ((0.0, None), (0.8, 4), (0.8, 5)):
            answer = generate(
                model, tokenizer, "Give a person as JSON. Like {\"name\":\"Ann\",\"age\":3}.", max_tokens=40,
                temperature=temperature, seed=seed, constraint=constraint, **options,
            )  # fmt: skip
            jsonschema.validate(json.loads(answer), PERSON)
    greedy = generate(model, tokenizer, "Give a person as JSON.", max_tokens=40, constraint=constraint)
    assert (
        generate(model, tokenizer, "Give a person as JSON.", max_tokens=40, constraint=constraint, prompt_lookup=3)
        == greedy
    )


@pytest.mark.slow
def test_the_end_of_sequence_id_waits_for_the_grammar(smollm2):
    """Biased towards ending, the answer still runs until the grammar accepts: 'stop', and the end id is not text."""
    model, tokenizer = smollm2
    (eos,) = tokenizer.eos_token_ids
    engine = Engine(model, tokenizer, max_batch=1)
    ids = tokenizer.encode("Count:", add_special_tokens=False)
    settings = SamplingSettings(max_tokens=20, constraint=Constraint.regex("[0-9]{4}"), logit_bias={eos: 100})
    engine.submit(Request(ids, settings))
    outputs = []
    while engine.busy:
        outputs += engine.step()
    assert re.fullmatch("[0-9]{4}", "".join(o.text for o in outputs))
    assert outputs[-1].finish_reason == "stop"


@pytest.mark.slow
def test_one_llguidance_tokenizer_per_tokenizer_from_gguf_or_folder(smollm2, tmp_path):
    _, tokenizer = smollm2
    assert guidance_tokenizer(tokenizer) is guidance_tokenizer(tokenizer)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    folder = Tokenizer.from_folder(tmp_path)
    ll = guidance_tokenizer(folder)
    assert ll is not guidance_tokenizer(tokenizer)
    assert (ll.vocab_size, ll.eos_tokens) == (guidance_tokenizer(tokenizer).vocab_size, [2])


@pytest.mark.slow
def test_a_model_vocabulary_wider_than_the_tokenizer_pads_the_mask(smollm2):
    from minimlx.decode.grammar import Matcher

    _, tokenizer = smollm2
    matcher = Matcher(Constraint.regex("[0-9]+"), tokenizer, tokenizer.vocab_size + 64)
    allowed = matcher.allowed()
    assert allowed.shape == (tokenizer.vocab_size + 64,) and not allowed[tokenizer.vocab_size :].any()
    assert {tokenizer.decode([i]) for i in range(32, 42)} == set("0123456789") and allowed[32:42].all()


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: Constraint.json_schema({"type": "hiccup"}), "hiccup"),
        (lambda: Constraint.json_schema({"type": 123}), "type must be"),
        (lambda: Constraint.json_schema([1, 2]), "object or a boolean"),
        (lambda: Constraint.json_schema(False), "matches no answer"),
        (lambda: Constraint.json_schema('{"type": '), "JSON schema"),
        (lambda: Constraint.gbnf("root ::= this is (not valid GBNF"), "gbnf"),
        (lambda: Constraint.regex("[a-"), "regex"),
        (lambda: Constraint.lark("start: foo"), "foo"),
        (lambda: Constraint("yaml", "a: b"), "kind"),
        (lambda: SamplingSettings(constraint='{"type": "object"}'), "Constraint"),
    ],
)
def test_bad_grammars_are_refused(make, fragment):
    with pytest.raises(InvalidSettingError, match=re.escape(fragment)) as info:
        make()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("as_text", [True, False])
@pytest.mark.parametrize("strict", [True, False])
def test_a_schema_nested_5000_deep_is_refused_quickly(as_text, strict):
    schema = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    start = time.perf_counter()
    with pytest.raises(InvalidSettingError, match="nested too deeply|recursion limit"):
        Constraint.json_schema(schema if as_text else _deep(5000), strict=strict)
    assert time.perf_counter() - start < 1


def _deep(levels):
    schema = node = {}
    for _ in range(levels):
        node["type"], node["items"] = "array", {}
        node = node["items"]
    return schema


@pytest.mark.slow
def test_run_constrains_the_answer_and_refuses_two_constraints(tmp_path):
    from click.testing import CliRunner
    from command_line import one_line_error

    from minimlx.cli import main

    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}}))
    result = CliRunner().invoke(main, ["run", "Capital of France?", "--json-schema", str(schema), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) in ({"city": "Paris"}, {"city": "Rome"}, {})
    runner = CliRunner()
    one_line_error(runner.invoke(main, ["run", "x", "--regex", "a", "--json-schema", str(schema)]), "give one of them")
    one_line_error(runner.invoke(main, ["run", "x", "--grammar", str(tmp_path / "absent.lark")]), "absent.lark")
    one_line_error(runner.invoke(main, ["run", "x", "--regex", "[a-"]), "regex")
    one_line_error(runner.invoke(main, ["run", "x", "--regex", ""]), "--regex is empty")
