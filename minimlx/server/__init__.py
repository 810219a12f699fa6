"""`minimlx serve`: the OpenAI (chat completions, completions, Responses) and Anthropic (Messages) HTTP APIs over
one decode engine."""

from .app import Server, serve

__all__ = ["Server", "serve"]
