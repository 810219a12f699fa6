"""JSON schemas the constrained-decoding tests sample answers for, through the engine and through the server."""

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 10}},
                "required": ["name"],
            },
            "country": {"type": "string", "maxLength": 10},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 10}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", 42]},
    {
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": PERSON, "maxItems": 2},
            "size": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["people", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["id"],
        "additionalProperties": False,
    },
]
