"""Which JSON schemas the grammar can enforce; `check_enforceable` refuses the others.

xgrammar compiles a JSON schema into a grammar, but drops some of its keywords
without a word: an array with `uniqueItems` gets repeated items, `allOf` of two
objects gets neither, a `not` gets anything. The answers then end normally
("stop") and fail the schema they were promised to match. Some schemas have no
finite answer at all (a required property that is the schema itself): the
grammar then forces an endless string, and finding it exhausts the memory.

So before a schema is compiled it is checked here, and refused, naming the
keyword and where it is (a JSON pointer), when:
- it uses a keyword the grammar does not enforce: `not`, `if`/`then`/`else`,
  `contains` (and `minContains`/`maxContains`), `dependentRequired`,
  `dependentSchemas`, `dependencies`, `uniqueItems: true`, `allOf` of more than
  one schema, `oneOf` whose branches may overlap (it is enforced as `anyOf`),
  validation keywords beside a `$ref`, and `minLength`/`maxLength` beside a
  `pattern`, or a `pattern` with look-around, word boundaries or `\\p` classes;
- a `$ref` is not a local JSON pointer, or names nothing;
- an `enum`/`const` value is not of the `type` beside it, or a required
  property is one that `additionalProperties: false` forbids;
- some part of it has no finite JSON value.
Annotations (`title`, `description`, `default`, `format`, ...) are fine: they
constrain nothing a validator checks by default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from vlm_catalog.structured.errors import GrammarError

NOT_ENFORCED = {
    "not": "the grammar cannot exclude what a schema matches",
    "if": "the grammar has no conditionals",
    "then": "the grammar has no conditionals",
    "else": "the grammar has no conditionals",
    "contains": "the grammar cannot require an item anywhere in an array",
    "minContains": "the grammar cannot count matching items",
    "maxContains": "the grammar cannot count matching items",
    "dependentRequired": "the grammar cannot make one property require another",
    "dependentSchemas": "the grammar cannot make one property constrain the others",
    "dependencies": "the grammar cannot make one property require another",
}
# keywords that constrain nothing a validator checks (by default), so any may stand beside a $ref
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor", "format", "contentEncoding", "contentMediaType", "contentSchema", "discriminator",
})
# regular-expression features the grammar's regex compiler ignores (with a log line only)
_UNENFORCED_PATTERN = re.compile(r"\(\?<?[=!]|(?<!\\)(?:\\\\)*\\[bBpP]")  # \b, not \\b (a backslash, then b)
_JSON_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_PRIMITIVES = frozenset({"null", "boolean", "integer", "number", "string"})


def check_enforceable(schema: dict[str, Any]) -> None:
    """Raise `GrammarError` unless the grammar enforces all of `schema` (module doc)."""
    nodes = list(_subschemas(schema))
    for pointer, node in nodes:
        _check_node(schema, pointer, node)
    finite = _finitely_satisfiable(schema, [node for _, node in nodes])
    for pointer, node in nodes:
        if not finite[id(node)]:
            raise GrammarError(
                f"json_schema {_where(pointer)}: no finite JSON value matches it (e.g. a required property that "
                "contains the schema itself), so no answer could ever end"
            )


def _where(pointer: str) -> str:
    return f"at {pointer!r}" if pointer else "at its root"


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, schema) for `schema` and every dict schema in it, wherever a schema may stand
    (not inside `enum`, `const`, `default` or `examples` values)."""
    pending: list[tuple[str, Any]] = [("", schema)]
    while pending:
        pointer, node = pending.pop()
        if not isinstance(node, dict):
            continue
        yield pointer, node
        for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            children = node.get(key)
            if isinstance(children, dict):
                pending.extend((f"{pointer}/{key}/{_escape(name)}", child) for name, child in children.items())
        for key in ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                    "additionalItems", "contains", "not", "if", "then", "else"):
            child = node.get(key)
            if isinstance(child, dict):
                pending.append((f"{pointer}/{key}", child))
            elif isinstance(child, list):  # items as a list (older drafts)
                pending.extend((f"{pointer}/{key}/{index}", item) for index, item in enumerate(child))
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            children = node.get(key)
            if isinstance(children, list):
                pending.extend((f"{pointer}/{key}/{index}", child) for index, child in enumerate(children))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_node(root: dict[str, Any], pointer: str, node: dict[str, Any]) -> None:
    where = _where(pointer)
    for keyword, reason in NOT_ENFORCED.items():
        if keyword in node:
            raise GrammarError(f"json_schema {where}: {keyword!r} is not supported ({reason})")
    if node.get("uniqueItems") is True:
        raise GrammarError(f"json_schema {where}: 'uniqueItems' is not supported (the grammar cannot keep items distinct)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise GrammarError(f"json_schema {where}: 'allOf' of {len(node['allOf'])} schemas is not supported "
                           "(write them as one schema)")
    if isinstance(node.get("oneOf"), list) and not _disjoint(root, node["oneOf"]):
        raise GrammarError(f"json_schema {where}: 'oneOf' whose branches may overlap is not supported (the grammar "
                           "cannot keep an answer to exactly one of them): use 'anyOf', or give each branch another "
                           "type or a distinct 'const' property")
    if "$ref" in node:
        _resolve(root, node["$ref"], where)
        beside = sorted(set(node) - ANNOTATIONS - {"$ref", "$defs", "definitions"})
        if beside:
            raise GrammarError(f"json_schema {where}: {', '.join(map(repr, beside))} beside a '$ref' is not "
                               "supported (the grammar follows the $ref alone): move it into the schema referred to")
    if "pattern" in node:
        if {"minLength", "maxLength"} & set(node):
            raise GrammarError(f"json_schema {where}: 'minLength'/'maxLength' beside a 'pattern' is not supported "
                               "(the grammar follows the pattern alone): put the length in the pattern, e.g. {1,20}")
        if isinstance(node["pattern"], str) and (found := _UNENFORCED_PATTERN.search(node["pattern"])):
            raise GrammarError(f"json_schema {where}: the pattern's '{found.group()}' is not supported "
                               "(look-around, word boundaries and \\p classes are ignored by the grammar)")
    _check_values_fit_type(node, where)
    _check_required_allowed(node, where)


def _check_values_fit_type(node: dict[str, Any], where: str) -> None:
    types = _types(node)
    if types is None:
        return
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    for value in values:
        if not any(_JSON_TYPES[kind](value) for kind in types if kind in _JSON_TYPES):
            raise GrammarError(f"json_schema {where}: the value {value!r} is not of type "
                               f"{' or '.join(sorted(types))} (the grammar would write it, and it could not validate)")


def _check_required_allowed(node: dict[str, Any], where: str) -> None:
    if node.get("additionalProperties") is not False or node.get("patternProperties"):
        return
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required", []) if isinstance(node.get("required"), list) else []:
        if name not in properties:
            raise GrammarError(f"json_schema {where}: the required property {name!r} is not in 'properties', and "
                               "'additionalProperties' is false, so no object could validate")


def _types(node: dict[str, Any]) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return None


def _resolve(root: dict[str, Any], reference: Any, where: str = "") -> Any:
    """The schema a local `$ref` ("#", "#/$defs/name") names; `where` it stands, for errors."""
    where = f"json_schema {where}" if where else "json_schema"
    if not isinstance(reference, str) or not reference.startswith("#"):
        raise GrammarError(f"{where}: $ref {reference!r} is not supported (only references within the "
                           "schema, such as '#/$defs/name')")
    target: Any = root
    for part in filter(None, unquote(reference[1:]).split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise GrammarError(f"{where}: $ref {reference!r} names nothing in the schema")
    return target


def _kinds(root: dict[str, Any], schema: Any, seen: frozenset[int] = frozenset()) -> set[str] | None:
    """The JSON types `schema` admits, or None if it may admit any (or that is not clear)."""
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    if "$ref" in schema:
        return _kinds(root, _resolve(root, schema["$ref"]), seen | {id(schema)})
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return {kind for kind, test in _JSON_TYPES.items() for value in values if test(value)}
    types = _types(schema)
    if types is not None and "number" in types:
        types = types | {"integer"}
    return types


def _disjoint(root: dict[str, Any], branches: list[Any]) -> bool:
    """Whether no JSON value can match two of `branches`: their types differ (integer and number
    overlap), or they are objects told apart by a required property with a distinct `const`."""
    kinds = [_kinds(root, branch) for branch in branches]
    if all(kind is not None for kind in kinds):
        seen: set[str] = set()
        for kind in kinds:
            if seen & kind:
                break
            seen |= kind
        else:
            return True
    return _discriminated(root, branches)


def _follow(root: dict[str, Any], schema: Any) -> Any:
    """`schema`, or the schema its `$ref` chain ends at (None for a chain that loops)."""
    seen: set[int] = set()
    while isinstance(schema, dict) and "$ref" in schema:
        if id(schema) in seen:
            return None
        seen.add(id(schema))
        schema = _resolve(root, schema["$ref"])
    return schema


def _discriminated(root: dict[str, Any], branches: list[Any]) -> bool:
    resolved = []
    for branch in branches:
        branch = _follow(root, branch)
        if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
            return False
        resolved.append(branch)
    shared = set.intersection(*(set(branch["properties"]) & set(branch.get("required", [])) for branch in resolved))
    for name in shared:
        values = [_const_of(root, branch["properties"][name]) for branch in resolved]
        if all(value is not _NO_CONST for value in values) and len({repr(v) for v in values}) == len(values):
            return True
    return False


_NO_CONST = object()


def _const_of(root: dict[str, Any], schema: Any) -> Any:
    schema = _follow(root, schema)
    if not isinstance(schema, dict):
        return _NO_CONST
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    return enum[0] if isinstance(enum, list) and len(enum) == 1 else _NO_CONST


def _finitely_satisfiable(root: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[int, bool]:
    """For each dict schema in `nodes`, whether some finite JSON value matches it, as far as its
    structure says (bounds are the compiler's to check): the least fixed point, starting from
    "none" and growing until nothing changes, so a schema that needs itself to end is never one."""
    finite = {id(node): False for node in nodes}

    def allows_one(schema: Any) -> bool:
        if isinstance(schema, dict):
            return finite.get(id(schema), True)
        return schema is not False

    changed = True
    while changed:
        changed = False
        for node in nodes:
            if not finite[id(node)] and _has_value(root, node, allows_one):
                finite[id(node)] = changed = True
    return finite


def _has_value(root: dict[str, Any], node: dict[str, Any], allows_one) -> bool:
    if "$ref" in node:
        return allows_one(_resolve(root, node["$ref"]))
    if "const" in node:
        return True
    if "enum" in node:
        return bool(node["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(allows_one(branch) for branch in node[key]):
            return False
    if isinstance(node.get("allOf"), list) and not all(allows_one(branch) for branch in node["allOf"]):
        return False
    types = _types(node)
    if types is None:  # a schema of no type: an object or array by its keywords, else anything
        if {"properties", "required", "additionalProperties"} & set(node):
            types = {"object"}
        elif {"items", "prefixItems", "minItems"} & set(node):
            types = {"array"}
        else:
            return True
    if types & _PRIMITIVES:
        return True
    if "object" in types:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if all(allows_one(properties.get(name, extra)) for name in required):
            return True
    if "array" in types:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True)
        least = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
        needed = [prefix[i] if i < len(prefix) else items for i in range(min(least, len(prefix) + 1))]
        if all(allows_one(item) if not isinstance(item, list) else True for item in needed):
            return True
    return False
