"""`minimlx serve`: the OpenAI (chat completions, completions, Responses, embeddings), Anthropic (Messages) and Ollama
HTTP APIs over one decode engine per loaded model (`Models`: one, or several loaded on demand within a budget)."""

from .app import Server, serve
from .models import Models, ServedModel, Serving

__all__ = ["Models", "Server", "ServedModel", "Serving", "serve"]
