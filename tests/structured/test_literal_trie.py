"""Radix-tree alternations: the same language as the flat alternation, fewer grammar positions.

Reference: Python set membership of the options. Every string that is an
option, a prefix of one, an option extended by a character, or random text over
the same alphabet is checked with xgrammar's string matcher.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from vlm_catalog.structured.compiler import JSON_SEPARATORS, json_schema_grammar
from vlm_catalog.structured.literal_trie import (
    factor_literal_alternations,
    literal_alternation_rules,
)

ALPHABET = ["a", "b", " > ", '"', "\\", "\n", "é", "😀"]


def random_text(rng: random.Random, max_pieces: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_pieces)))


def probes(options: list[str], rng: random.Random) -> set[str]:
    texts = set(options)
    for option in options:
        texts.update(option[:cut] for cut in range(len(option)))
        texts.update(option + piece for piece in ALPHABET)
    texts.update(random_text(rng, 5) for _ in range(30))
    return texts


@pytest.mark.parametrize("seed", range(25))
def test_same_language_as_the_options(seed):
    rng = random.Random(seed)
    options = [random_text(rng, 5) for _ in range(rng.randint(1, 9))]
    options += rng.sample(options, k=min(2, len(options)))  # duplicates are allowed
    grammar = xgr.Grammar.from_ebnf("\n".join(literal_alternation_rules("root", options)))
    for text in probes(options, rng):
        assert grammar_accepts(grammar, text) == (text in options), (options, text)


def test_helper_rule_names_avoid_taken_names():
    rules = literal_alternation_rules("root", ["ab", "ac", "abd"], taken={"root_trie_1"})
    names = [rule.split(" ::= ")[0] for rule in rules]
    assert names[0] == "root"
    assert "root_trie_1" not in names
    assert len(set(names)) == len(names)


def test_no_options_is_an_error():
    with pytest.raises(ValueError, match="at least one option"):
        literal_alternation_rules("root", [])


def schema_with_enum(values: list[str]) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {"c": {"enum": values}, "n": {"type": "integer"}},
            "required": ["c", "n"],
            "additionalProperties": False,
        }
    )


def flat_grammar(schema_text: str) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, separators=JSON_SEPARATORS)


def test_json_schema_enum_keeps_its_language():
    values = ["Café > Crème", "Café > Thé", 'say "hi"', "back\\slash", "tab\there", "ctl\x01", "emoji 😀", "C"]
    schema_text = schema_with_enum(values)
    factored, flat = json_schema_grammar(schema_text), flat_grammar(schema_text)
    assert "root_prop_0_trie_1" in str(factored)  # the enum was rewritten
    texts = [json.dumps({"c": value, "n": 3}, ensure_ascii=False, separators=JSON_SEPARATORS) for value in values]
    texts += [text.replace("é", "e") for text in texts] + ['{"c":"Café","n":3}', '{"c":"Café > ","n":3}']
    for text in texts:
        expected = json.loads(text)["c"] in values
        assert grammar_accepts(factored, text) == expected == grammar_accepts(flat, text), text


def literal_characters(ebnf: str) -> int:
    return sum(len(literal) for literal in re.findall(r'"(?:[^"\\]|\\.)*"', ebnf))


def test_taxonomy_candidates_need_far_fewer_positions(candidate_lists):
    """The reason for the module: a record's candidates share long path prefixes."""
    flat = factored = 0
    for candidates in candidate_lists[:50]:
        encoded = [json.dumps(candidate) for candidate in candidates]
        flat += literal_characters(" | ".join(encoded))
        factored += literal_characters("\n".join(literal_alternation_rules("root", encoded)))
    assert factored < 0.6 * flat, (factored, flat)


def test_unknown_escape_keeps_the_rule():
    ebnf = 'root ::= (("\\q") | ("b"))'
    assert factor_literal_alternations(ebnf) == ebnf
