"""The simulated engine tokenizes with the project's one tokenizer (llmd.tokens), which the router shares."""

from llmd.tokens.chat import ChatTemplateError
from llmd.tokens.tokenizer import IncrementalDetokenizer, Tokenizer

SimTokenizer = Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "SimTokenizer", "Tokenizer"]
