"""Decoding, in one place: the settings of a generation, the engine that batches sequences (with its compiled
step and speculative rounds), and the calls built on it (`generate`, `stream_generate`, `batch_generate`, the
conversation)."""

from .conversation import Conversation
from .engine import Engine, Generation, Output, Request, split_at_stop
from .generate import GenerationResponse, batch_generate, generate, generate_tokens, make_cache, stream_generate
from .grammar import Constraint
from .prompt import check_ids, check_prompt, encode_prompt, vocab_size
from .prompt_cache import PromptCache, SavedPrompt, load_prompt_cache, save_prompt_cache
from .settings import SamplingSettings, check_whole

__all__ = [
    "Constraint",
    "Conversation",
    "Engine",
    "Generation",
    "GenerationResponse",
    "Output",
    "PromptCache",
    "Request",
    "SamplingSettings",
    "SavedPrompt",
    "batch_generate",
    "check_ids",
    "check_prompt",
    "check_whole",
    "encode_prompt",
    "generate",
    "generate_tokens",
    "load_prompt_cache",
    "make_cache",
    "save_prompt_cache",
    "split_at_stop",
    "stream_generate",
    "vocab_size",
]
