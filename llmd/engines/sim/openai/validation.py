"""vLLM's checks of a parsed request against the model: output budget, prompt length, sampling parameters and the
engine's input checks, with vLLM's messages and in its order."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import validation_error
from .requests import GenerateRequest

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES default
SAMPLING_EPS = 1e-5


def check_max_tokens(req: GenerateRequest, max_model_len: int) -> None:
    """vLLM's TokenizeParams check, done before tokenizing: no output budget beyond the context length."""
    s = req.sampling
    if s.max_tokens is not None and s.max_tokens > max_model_len:
        raise validation_error(
            f"{s.max_tokens_param}={s.max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            s.max_tokens_param,
            s.max_tokens,
        )


def check_text_length(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """vLLM's renderer check on a text prompt before tokenizing (TokenizeParams._text_len_check): a text longer than
    max_model_len tokens of the longest vocabulary piece cannot fit."""
    limit = max_model_len * max_chars_per_token
    if len(text) > limit:
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(text)} characters (more than {limit} characters, which is the upper bound for {max_model_len} "
            "input tokens). Please reduce the length of the input prompt.",
            "input_text",
            len(text),
        )


def check_prompt_length(prompt_ids: Sequence[int], max_model_len: int, *, from_text: bool) -> None:
    """vLLM's renderer check after tokenizing (TokenizeParams._token_len_check). vLLM tokenizes text with truncation
    at max_model_len + 1, so a long text always counts max_model_len + 1 tokens, "at least" that many."""
    n = len(prompt_ids)
    if n > max_model_len:
        count = max_model_len + 1 if from_text else n
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def effective_max_tokens(req: GenerateRequest, prompt_len: int, max_model_len: int) -> int:
    """vLLM's get_max_tokens: the request's budget clamped to the room left in the context (may be < 1: the sampling
    checks refuse that)."""
    s = req.sampling
    budget = max_model_len - prompt_len
    if s.max_tokens is not None:
        budget = min(budget, s.max_tokens)
    return budget


def check_sampling(req: GenerateRequest, max_tokens: int) -> None:
    """SamplingParams.__post_init__ (_verify_args, then the greedy check) for the parameters the sim honours, in
    vLLM's order; `max_tokens` is the effective budget of one prompt."""
    s = req.sampling
    if s.n < 1:
        raise validation_error(f"n must be at least 1, got {s.n}.")
    if s.n > MAX_N_SEQUENCES:
        raise validation_error(
            f"n must be at most {MAX_N_SEQUENCES}, got {s.n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        )
    t = s.temperature
    if t != t or t in (float("inf"), float("-inf")):
        raise validation_error(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise validation_error(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise validation_error(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < s.top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {s.top_p}.", "top_p", s.top_p)
    if max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if s.min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.")
    if s.min_tokens > max_tokens:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {s.min_tokens}.")
    if s.logprobs is not None and s.logprobs != -1 and s.logprobs < 0:
        raise validation_error(f"logprobs must be non-negative or -1, got {s.logprobs}.", "logprobs", s.logprobs)
    if s.prompt_logprobs is not None and s.prompt_logprobs != -1 and s.prompt_logprobs < 0:
        num = s.prompt_logprobs
        raise validation_error(f"prompt_logprobs must be non-negative or -1, got {num}.", "prompt_logprobs", num)
    if t < SAMPLING_EPS and s.n > 1:
        raise validation_error(f"n must be 1 when using greedy sampling, got {s.n}.")


def check_engine_input(req: GenerateRequest, prompt_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """The input processor's checks when the request reaches the engine: parameters against the model
    (SamplingParams.verify), then the prompt (length, then vocabulary)."""
    s = req.sampling
    for name, num in (("sample", s.logprobs), ("prompt", s.prompt_logprobs)):
        if num:
            wanted = vocab_size if num == -1 else num
            if wanted > MAX_LOGPROBS:
                param = "logprobs" if name == "sample" else "prompt_logprobs"
                raise validation_error(
                    f"Requested {name} logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                    param,
                    wanted,
                )
    n = len(prompt_ids)
    if n == 0:
        raise validation_error("The decoder prompt cannot be empty")
    if n > max_model_len:
        raise validation_error(
            f"The decoder prompt (length {n}) is longer than the maximum model length of {max_model_len}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens."
        )
    if n == max_model_len:
        raise validation_error(
            f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer than "
            f"the maximum model length of {max_model_len}. Make sure that `max_model_len` is no smaller than the "
            "number of text tokens (prompt + requested output tokens)."
        )
    lo, hi = min(prompt_ids), max(prompt_ids)
    if lo < 0:
        raise validation_error(f"Token id {lo} is out of vocabulary")
    if hi > vocab_size - 1:
        raise validation_error(f"Token id {hi} is out of vocabulary")
