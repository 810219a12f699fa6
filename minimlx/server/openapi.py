"""The OpenAPI 3.1 description the server publishes at /openapi.json: its endpoints and their request bodies,
with the limits the server enforces, so that clients and tools (schemathesis, in the tests) can read them."""

STRING = {"type": "string"}
TEXT_PARTS = {
    "type": "array",
    "items": {"type": "object", "properties": {"type": STRING, "text": STRING}, "required": ["text"]},
}
TEXT = {"anyOf": [STRING, TEXT_PARTS]}
JSON_OBJECT = {"type": "object"}
SAMPLING = {
    "model": STRING,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
}
OPENAI_SAMPLING = {
    **SAMPLING,
    "max_tokens": {"type": "integer", "minimum": 1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stop": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 4},
        ]
    },
    "n": {"type": "integer", "minimum": 1},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": STRING,
}
FUNCTION_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                "description": STRING,
                "parameters": JSON_OBJECT,
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": TEXT,
        "tool_call_id": STRING,
    },
    "required": ["role", "content"],
}
CHAT_REQUEST = {
    "type": "object",
    "properties": {
        **OPENAI_SAMPLING,
        "messages": {"type": "array", "items": CHAT_MESSAGE, "minItems": 1, "maxItems": 10_000},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "tools": {"type": "array", "items": FUNCTION_TOOL, "maxItems": 128},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none"]}]},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        "metadata": JSON_OBJECT,
        "store": {"type": "boolean"},
    },
    "required": ["messages"],
}
COMPLETION_REQUEST = {
    "type": "object",
    "properties": {
        **OPENAI_SAMPLING,
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1},
            ]
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["prompt"],
}
RESPONSES_REQUEST = {
    "type": "object",
    "properties": {
        **{k: v for k, v in SAMPLING.items() if k != "top_k"},
        "input": {
            "anyOf": [
                STRING,
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}, "content": TEXT},
                        "required": ["role", "content"],
                    },
                    "minItems": 1,
                    "maxItems": 10_000,
                },
            ]
        },
        "instructions": STRING,
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {
            "type": "object",
            "properties": {"format": {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}}},
        },
        "metadata": JSON_OBJECT,
        "store": {"type": "boolean"},
    },
    "required": ["input"],
}
ANTHROPIC_MESSAGE = {
    "type": "object",
    "properties": {"role": {"enum": ["user", "assistant"]}, "content": TEXT},
    "required": ["role", "content"],
}
ANTHROPIC_TOOL = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "input_schema": JSON_OBJECT},
    "required": ["name", "input_schema"],
}
COUNT_TOKENS_REQUEST = {
    "type": "object",
    "properties": {
        "model": STRING,
        "system": TEXT,
        "messages": {"type": "array", "items": ANTHROPIC_MESSAGE, "maxItems": 10_000},
        "tools": {"type": "array", "items": ANTHROPIC_TOOL, "maxItems": 128},
    },
    "required": ["messages"],
}
MESSAGES_REQUEST = {
    "type": "object",
    "properties": {
        **COUNT_TOKENS_REQUEST["properties"],
        **SAMPLING,
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        "metadata": JSON_OBJECT,
    },
    "required": ["max_tokens", "messages"],
}
OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"message": STRING, "type": STRING, "param": {"type": ["string", "null"]}, "code": {}},
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
ANTHROPIC_ERROR = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "properties": {"type": STRING, "message": STRING}, "required": ["type", "message"]},
    },
    "required": ["type", "error"],
}


def optional_nulls(schema: dict) -> dict:
    """`schema` with null allowed for each optional field: the server reads a null as the field left out."""
    required = schema["required"]
    properties = {k: v if k in required else {"anyOf": [v, {"type": "null"}]} for k, v in schema["properties"].items()}
    return {**schema, "properties": properties}


def operation(summary: str, body: dict | None, error: dict) -> dict:
    """One endpoint: its JSON request body (None for a GET), an object answer, its errors' shape."""
    answer = {"content": {"application/json": {"schema": JSON_OBJECT}}}
    refused = {"content": {"application/json": {"schema": error}}}
    described = {"summary": summary, "responses": {"200": {"description": "the answer", **answer}}}
    for status, why in [("400", "a bad request"), ("401", "a missing or wrong API key"), ("413", "a body too large")]:
        described["responses"][status] = {"description": why, **refused}
    if body is not None:
        schema = {"application/json": {"schema": optional_nulls(body)}}
        described["requestBody"] = {"required": True, "content": schema}
    return described


OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "minimlx serve", "version": "1"},
    "paths": {
        "/health": {"get": {"summary": "up, and not shutting down", "responses": {"200": {"description": "ok"}}}},
        "/v1/models": {"get": operation("the model served", None, OPENAI_ERROR)},
        "/v1/chat/completions": {"post": operation("OpenAI chat completions", CHAT_REQUEST, OPENAI_ERROR)},
        "/v1/completions": {"post": operation("OpenAI completions of raw text", COMPLETION_REQUEST, OPENAI_ERROR)},
        "/v1/responses": {"post": operation("OpenAI Responses, stateless", RESPONSES_REQUEST, OPENAI_ERROR)},
        "/v1/messages": {"post": operation("Anthropic Messages", MESSAGES_REQUEST, ANTHROPIC_ERROR)},
        "/v1/messages/count_tokens": {
            "post": operation("the prompt tokens of a Messages body", COUNT_TOKENS_REQUEST, ANTHROPIC_ERROR)
        },
    },
}
