"""Constrained decoding: a grammar the answer must match, enforced token by token with llguidance.

A `Constraint` is checked once, when it is made (compiled without a tokenizer), so a bad schema or grammar is
refused before any work. During generation each constrained sequence has a `Matcher`: it follows the tokens the
sequence takes and says which tokens may come next, as a mask over the model's vocabulary. llguidance's view of
the vocabulary (an `LLTokenizer`, about a quarter of a second to build) is made once per tokenizer and shared.
"""

import json
import weakref
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ..errors import InvalidSettingError

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


def closed(schema):
    """`schema` with `additionalProperties: false` wherever an object schema leaves it unsaid: OpenAI's strict
    mode, where an object holds the properties it lists and no others. Walked with a stack, not recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                node.setdefault("additionalProperties", False)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def schema_text(schema, strict: bool) -> str:
    """The schema (a dict, a bool or JSON text) as JSON text, closed when `strict` (the caller's dict untouched).
    `true` is the schema `{}`; `false`, which no answer matches, is refused."""
    if schema is True or schema == "true":
        return "{}"
    if schema is False or schema == "false":
        raise InvalidSettingError("the JSON schema false matches no answer; give one that some JSON matches")
    try:
        if isinstance(schema, str) and not strict:
            return schema  # llguidance parses it (and refuses nesting too deep to follow)
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return json.dumps(closed(json.loads(text))) if strict else text
    except RecursionError:
        raise InvalidSettingError("the JSON schema is nested too deeply to compile; flatten it") from None
    except (TypeError, ValueError) as e:
        raise InvalidSettingError(f"the JSON schema is not valid JSON ({e}); give a JSON object") from None


@dataclass(frozen=True)
class Constraint:
    """A grammar the answer must match."""

    kind: str  # "json_schema" | "json_object" | "regex" | "lark" | "gbnf"
    source: str  # the schema as JSON text, the pattern, or the grammar text

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidSettingError(f"a constraint's kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise InvalidSettingError(f"a {self.kind} constraint takes text, got {type(self.source).__name__}")
        failed, messages = LLMatcher.validate_grammar_with_warnings(self.grammar())
        if failed:
            reason = " ".join(messages[0].split())
            raise InvalidSettingError(f"the {self.kind.replace('_', ' ')} does not compile ({reason}); fix it")

    @classmethod
    def json_schema(cls, schema, strict: bool = False) -> "Constraint":
        """JSON matching `schema` (a dict, a bool or JSON text). `strict` closes every object the schema leaves
        open (OpenAI's strict mode); otherwise an object may hold other properties where the schema allows them."""
        return cls("json_schema", schema_text(schema, strict))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text the regular expression matches whole (Rust's regex syntax)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Text of llguidance's Lark dialect (`start: ...`, `%json {...}` for a schema, `<|name|>` special tokens)."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """Text of llama.cpp's GBNF (`root ::= ...`)."""
        return cls("gbnf", grammar)

    def grammar(self) -> str:
        """The constraint as an llguidance grammar. JSON comes compact (no whitespace between tokens) unless the
        schema's own "x-guidance" options say otherwise."""
        if self.kind in ("json_schema", "json_object"):
            try:
                return LLMatcher.grammar_from_json_schema(self.source, defaults={"whitespace_flexible": False})
            except ValueError as e:
                raise InvalidSettingError(
                    f"the JSON schema must be a JSON object or a boolean ({e}); give one"
                ) from None
        try:
            return llguidance.grammar_from(self.kind, self.source)
        except ValueError as e:
            reason = " ".join(str(e).split())
            raise InvalidSettingError(f"the {self.kind} grammar does not parse ({reason}); fix it") from None


TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # minimlx Tokenizer -> its LLTokenizer


def guidance_tokenizer(tokenizer) -> LLTokenizer:
    """llguidance's view of `tokenizer` (a minimlx Tokenizer), built on its first use and kept with it."""
    if tokenizer not in TOKENIZERS:
        try:
            TOKENIZERS[tokenizer] = LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.eos_token_ids)
            )
        except ValueError as e:  # llguidance reads byte-level BPE and SentencePiece vocabularies, not every kind
            raise InvalidSettingError(
                f"this model's tokenizer cannot be constrained by a grammar ({e}); send the request without one"
            ) from None
    return TOKENIZERS[tokenizer]


class Matcher:
    """One sequence's place in its grammar: which tokens may come next, as a mask `vocab` wide (the model's
    vocabulary, which may be wider than the tokenizer's: ids past the tokenizer's are never allowed)."""

    def __init__(self, constraint: Constraint, tokenizer, vocab: int):
        self.tokenizer = guidance_tokenizer(tokenizer)
        self.matcher = LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
        if self.matcher.is_error():
            raise InvalidSettingError(f"the {constraint.kind} constraint does not compile: {self.matcher.get_error()}")
        self.vocab = vocab
        self.eos = frozenset(self.tokenizer.eos_tokens)
        self.bits = allocate_token_bitmask(1, self.tokenizer.vocab_size)

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and allows nothing more (or the matcher failed)."""
        return self.matcher.is_stopped()

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next (the end-of-sequence ids once it accepts)."""
        fill_next_token_bitmask(self.matcher, self.bits)
        bits = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab].view(bool)
        return np.pad(bits, (0, self.vocab - bits.size))

    def ends(self, token: int) -> bool:
        """Whether `token` is an end-of-sequence id (allowed once the grammar accepts)."""
        return token in self.eos

    def checked(self, drafts: list[int]) -> int:
        """How many drafted tokens the model should check: those the grammar allows, and the first one it rejects
        (the verifier, whose mask forbids it, then rejects it: a sampled round draws its token from what the
        drafter did not propose, as exact speculative sampling needs)."""
        return min(self.matcher.validate_tokens(drafts) + 1, len(drafts))

    def masks(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts) + 1, vocab) bool: the grammar's mask before each draft and after the last, the grammar left
        where it was. Past a draft the grammar rejects (or once it is complete) nothing is masked: no token there
        is kept."""
        masks, consumed = [self.allowed()], 0
        for token in drafts:
            if self.matcher.is_stopped() or self.matcher.try_consume_tokens([token]) != 1:
                break
            consumed += 1
            masks.append(self.allowed() if not self.matcher.is_stopped() else np.ones(self.vocab, bool))
        self.matcher.rollback(consumed)
        return np.stack(masks + [np.ones(self.vocab, bool)] * (len(drafts) + 1 - len(masks)))
