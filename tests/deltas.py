"""Reading ReplyParser's deltas back as one message, as the tests of the reply formats check them."""

from minimlx.text.replies import Delta


def joined_reply(deltas: list[Delta]) -> tuple[str | None, str | None, list[dict]]:
    """A whole reply's deltas as one message: content and reasoning (None when there is none), and the calls in
    OpenAI's shape, `{"id", "type": "function", "function": {"name", "arguments"}}`."""
    texts = {"content": "", "reasoning": ""}
    calls = []
    for delta in deltas:
        if delta.kind == "tool_call":
            calls.append({"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}})
        elif delta.kind == "arguments":
            calls[delta.index]["function"]["arguments"] += delta.text
        else:
            texts[delta.kind] += delta.text
    return texts["content"] or None, texts["reasoning"] or None, calls
