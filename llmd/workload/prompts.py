"""Real chat text with exact token counts for planned turns: each turn appends messages (assistant output, tool
result) to the previous turn's conversation, so prefix caching sees what it sees from a real agent.

Counts are additive, never re-tokenizing the whole context: content is lines of letter-only words, each word a
pre-tokenizer chunk of its own (" word", or "word" after a newline, the newline a token of its own), and chat framing
costs are measured once per tokenizer. tests/test_workload.py checks the sum against a full tokenization; for
tokenizers whose pre-tokenizer splits otherwise this is an approximation (`verify` re-tokenizes to check).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmd.workload.sessions import SessionPlan, Turn

VOCAB = tuple(
    """the a of to and in is for that with on as it be this by are from at or an not return self def class import
    value data result error file path line test function call list dict string number index key name type node
    config request response token cache block server client model agent session turn query update create delete
    read write open close start stop check run build load save parse format match find replace split join print
    input output context prompt message system user assistant tool args kwargs lambda yield async await true false
    none if else while try except raise pass break continue global local module package version option default
    buffer stream socket thread process memory worker queue batch shard layer tensor weight bias grad step loss
    router engine prefill decode transfer event hash count total size limit offset length width height depth
    when then there here which where what because after before under over between into through without within""".split()  # noqa: SIM905
)


_PICKS = 1 << 16
_SP_WORDS = tuple(" " + w for w in VOCAB)
_NL_WORDS = tuple("\n" + w for w in VOCAB)


@dataclass(frozen=True, slots=True)
class PromptTurn:
    """A turn as a chat request: `messages` (system + user + assistant/tool pairs) whose rendered prompt has exactly
    `turn.input_tokens` tokens; `output_text` is a stand-in assistant reply of exactly `turn.output_tokens` tokens
    that the next turn appends (a live driver may append the model's real reply instead)."""

    turn: Turn
    messages: list[dict[str, Any]]
    output_text: str


class PromptWriter:
    """Writes deterministic text of exact token counts for one tokenizer and one run salt.

    Every message needs at least one token of content beyond its fixed chat framing, so a prompt has a minimum
    renderable size: `min_context(system_tokens)` for a fresh context (session start, reset, compaction), `min_step`
    for an appended assistant + tool step and `min_fork_task` for a sub-agent's task message, and `min_system` for
    the salted system prompt. The planner's floors (llmd.workload.sessions: MIN_SYSTEM_TOKENS, MIN_TASK_TOKENS,
    MIN_NEW_TOKENS) exceed these for common chat templates; should a plan still ask for less, the writer clamps the
    text to one token (never raises): that prompt and the session's later ones then exceed the plan by the shortfall.
    """

    def __init__(self, tokenizer: Any, salt: str) -> None:
        self.tok = tokenizer
        self.salt = salt
        enc = tokenizer.encode
        self._sp = np.array([len(enc(" " + w, add_special_tokens=False)) for w in VOCAB])
        self._ns = np.array([len(enc(w, add_special_tokens=False)) for w in VOCAB])
        self._nl = len(enc("a\nb", add_special_tokens=False)) - self._ns[VOCAB.index("a")] - self._ns[1]
        self._one_sp = np.flatnonzero(self._sp == 1)
        self._one_ns = np.flatnonzero(self._ns == 1)
        if not len(self._one_sp) or not len(self._one_ns):
            raise ValueError("the tokenizer has no one-token vocabulary word; exact counts are not possible")
        # Plain ints for the per-word loop of `text` (numpy scalars cost ~10x there).
        self._ns_l, self._sp_l = self._ns.tolist(), self._sp.tolist()
        self._one_ns_w, self._one_sp_w = int(self._one_ns[0]), int(self._one_sp[0])
        self._nl = int(self._nl)
        self._salt_cost = len(enc(salt, add_special_tokens=False)) if salt else 0
        # One fixed stream of word picks; a key starts at its own offset in it. Seeding a Generator per text cost
        # more than writing a short text (the load generator writes two texts a turn, on its event loop).
        self._picks = np.random.default_rng(0x1D1D).integers(0, len(VOCAB), size=_PICKS).tolist()

        def n(msgs: list[dict[str, Any]], gen: bool = True) -> int:
            return len(tokenizer.chat_token_ids(msgs, add_generation_prompt=gen))

        sys_, usr = {"role": "system", "content": "value"}, {"role": "user", "content": "data"}
        c = int(self._ns[VOCAB.index("value")]), int(self._ns[VOCAB.index("data")])
        self._init_cost = n([sys_, usr]) - c[0] - c[1]
        ast, tool = (
            {"role": "assistant", "content": "result"},
            {"role": "tool", "content": "error", "tool_call_id": _call_id(1)},
        )
        self._step_cost = n([sys_, usr, ast, tool]) - n([sys_, usr]) - self._ns[VOCAB.index("result")]
        self._step_cost -= self._ns[VOCAB.index("error")]
        self._fork_cost = n([sys_, usr, usr]) - n([sys_, usr]) - c[1]

    # -- minimum renderable sizes --------------------------------------------------------------------------------

    @property
    def min_system(self) -> int:
        """Fewest tokens of a system prompt: the salt, a newline and one token of text."""
        return self._salt_cost + self._nl + 1 if self.salt else 1

    def min_context(self, system_tokens: int) -> int:
        """Fewest tokens of a fresh context's prompt: the system prompt, the framing and one token of user text."""
        return max(system_tokens, self.min_system) + self._init_cost + 1

    @property
    def min_step(self) -> int:
        """Fewest tokens an appended step (assistant reply framing + tool result) adds beyond the reply text."""
        return int(self._step_cost) + 1

    @property
    def min_fork_task(self) -> int:
        """Fewest tokens of a sub-agent's task message (framing + one token of text)."""
        return self._fork_cost + 1

    @staticmethod
    def _fit(n_tokens: int, framing: int) -> int:
        """Tokens of text for a message of `n_tokens` with `framing`: at least one (the clamp of the class doc)."""
        return max(1, int(n_tokens) - int(framing))

    # -- text ---------------------------------------------------------------------------------------------------

    def text(self, n_tokens: int, key: str) -> str:
        """Lines of words, exactly `n_tokens` tokens (>= 1), the same for the same key."""
        if n_tokens < 1:
            raise ValueError(f"need at least one token of text, got {n_tokens}")
        picks, ns, sp, nl = self._picks, self._ns_l, self._sp_l, self._nl
        one_ns, one_sp = self._one_ns_w, self._one_sp_w
        i = zlib.crc32(key.encode()) % _PICKS
        out: list[str] = []
        left = n_tokens
        col = 0
        while left > 0:
            w = picks[i]
            i = i + 1 if i + 1 < _PICKS else 0
            if col == 0:
                if ns[w] > left:
                    w = one_ns
                out.append(VOCAB[w])
                left -= ns[w]
                col = 1
            elif col >= 12 and left > nl + ns[w]:
                out.append(_NL_WORDS[w])
                left -= nl + ns[w]
                col = 1
            else:
                if sp[w] > left:
                    w = one_sp
                out.append(_SP_WORDS[w])
                left -= sp[w]
                col += 1
        return "".join(out)

    def system_prompt(self, n_tokens: int) -> str:
        """The shared system prompt, headed by the run salt so no run reuses another run's cache."""
        if not self.salt:
            return self.text(max(1, n_tokens), "system")
        return self.salt + "\n" + self.text(self._fit(n_tokens, self._salt_cost + self._nl), "system")

    # -- sessions -----------------------------------------------------------------------------------------------

    def session(self, plan: SessionPlan, system_tokens: int, parent: PromptTurn | None = None):
        """Yield a PromptTurn per turn of `plan`; a sub-agent plan needs `parent`, its parent's PromptTurn at the
        fork turn (unless its first turn is a reset or a compaction). Text sizes are clamped to the minimum renderable
        size (see the class doc), so a small plan never raises."""
        messages: list[dict[str, Any]] = []
        prev: PromptTurn | None = None
        for turn in plan.turns:
            key = f"{plan.session_id}/{turn.turn_index}"
            if turn.turn_index == 0 and turn.is_subagent and not (turn.reset or turn.compaction):
                if parent is None:
                    raise ValueError(f"sub-agent {plan.session_id} needs its parent's PromptTurn")
                task = self._fit(turn.new_tokens, self._fork_cost)
                messages = [*parent.messages, {"role": "user", "content": self.text(task, key + "/task")}]
            elif prev is None or turn.reset or turn.compaction:
                sys_text = self.system_prompt(system_tokens)
                body = self._fit(turn.input_tokens, max(system_tokens, self.min_system) + self._init_cost)
                what = "summary" if turn.compaction else "task"
                messages = [
                    {"role": "system", "content": sys_text},
                    {"role": "user", "content": self.text(body, f"{key}/{what}")},
                ]
            else:
                tool = self._fit(turn.new_tokens, self._step_cost)
                messages = [
                    *messages,
                    {"role": "assistant", "content": prev.output_text},
                    {
                        "role": "tool",
                        "content": self.text(tool, key + "/tool"),
                        "tool_call_id": _call_id(turn.turn_index),
                    },
                ]
            prev = PromptTurn(turn, messages, self.text(turn.output_tokens, key + "/out"))
            yield prev

    def count(self, messages: list[dict[str, Any]]) -> int:
        """The full tokenization (slow on large contexts; for checks)."""
        return len(self.tok.chat_token_ids(messages, add_generation_prompt=True))


def _call_id(turn_index: int) -> str:
    """A tool message's tool_call_id: the OpenAI schema requires one (sglang-router refuses a tool message without
    it; vLLM's chat types require it too). Fixed width, so a chat template that renders it costs the same every turn."""
    return f"call{turn_index:06d}"
