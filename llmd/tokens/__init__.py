"""Prompt tokens, the one way: the engine and the router tokenize (and render chat templates) through here.

`Tokenizer` is a model folder's tokenizer as vLLM uses it; `llmd.tokens.chat` turns chat requests into prompt text as
vLLM does; `PromptCache` tokenizes and block-hashes agentic prompts one turn at a time, always equal to doing it whole.
"""

from llmd.tokens.chat import ChatMessageError, ChatTemplateError, normalize_messages
from llmd.tokens.incremental import Encoded, PromptCache
from llmd.tokens.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "ChatMessageError",
    "ChatTemplateError",
    "Encoded",
    "IncrementalDetokenizer",
    "PromptCache",
    "Tokenizer",
    "normalize_messages",
]
