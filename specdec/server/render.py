"""A response's choices, whole or as stream chunks: text (with echo), logprobs and tool calls.

One ``ChoiceRenderer`` per request. The engine thread sends text deltas (``scheduler.Event``); the
renderer adds what the request asked for, reading each choice's ``Sequence`` (its logprobs, its
prompt): OpenAI's ``logprobs`` objects (server/logprobs.py), ``tool_calls`` parsed from the
model's own format (server/tools.py, finish reason ``tool_calls``), and completions' ``echo``.
Streamed chunks joined give exactly the non-streamed choice: the same parser runs on both.
"""
from __future__ import annotations

from specdec.formats.tokenizer import Tokenizer
from specdec.runtime.sequence import Sequence
from specdec.server.logprobs import LogprobFormatter
from specdec.server.protocol import ChatCompletionRequest
from specdec.server.tools import ToolCallParser, parse_tool_calls


class ChoiceRenderer:
    """``final`` (non-streamed choices) or ``chunks`` per event (streamed), for one request."""

    def __init__(self, req, seqs: list[Sequence], tokenizer: Tokenizer, chat: bool) -> None:
        self.seqs, self.chat = seqs, chat
        self.fmt = LogprobFormatter(tokenizer)
        self.tools = chat and isinstance(req, ChatCompletionRequest) and req.tool_mode() != "off"
        self.parallel = not (chat and req.parallel_tool_calls is False)
        self.names = frozenset(t.function.name for t in req.tools) if self.tools else frozenset()
        self.parsers = [ToolCallParser(self.parallel, self.names) if self.tools else None for _ in seqs]
        self.ncalls = [0] * len(seqs)
        self.sent_lp = [0] * len(seqs)  # output logprobs already streamed
        self.offset = [0] * len(seqs)  # completions' text_offset of the next streamed token
        self.echo = not chat and req.echo
        if self.echo:  # the prompt each choice echoes: the request's string, or its tokens decoded
            raw = req.prompts()
            per = len(seqs) // len(raw)
            self.prompt_text = [raw[i // per] if isinstance(raw[i // per], str)
                                else tokenizer.decode(raw[i // per], skip_special_tokens=False)
                                for i in range(len(seqs))]
        self.echoed = [not self.echo] * len(seqs)

    def _wants_lp(self, i: int) -> bool:
        return self.seqs[i].params.logprobs is not None

    # ---- whole responses ------------------------------------------------------------------
    def final(self, texts: list[str], reasons: list[str | None]) -> list[dict]:
        return [self._final(i, t, r) for i, (t, r) in enumerate(zip(texts, reasons))]

    def _final(self, i: int, text: str, reason: str | None) -> dict:
        s = self.seqs[i]
        if self.chat:
            content, calls = parse_tool_calls(text, self.parallel, self.names) if self.tools else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
            lp = self.fmt.chat(list(s.output_logprobs)) if self._wants_lp(i) else None
            return {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
        lp = None
        if self._wants_lp(i):
            lp = self.fmt.completion(list(s.prompt_logprobs) + list(s.output_logprobs) if self.echo
                                     else list(s.output_logprobs), first=s.prompt_ids[0] if self.echo else None)
        text = self.prompt_text[i] + text if self.echo else text
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    # ---- streams --------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat: the role chunk of every choice (before any text)."""
        if not self.chat:
            return []
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.seqs))]

    def chunks(self, i: int, text: str, finish_reason: str | None) -> list[dict]:
        """The chunk choices for one event of choice ``i`` (none when everything is held back)."""
        out = [] if self.echoed[i] else [self._echo_chunk(i)]
        s = self.seqs[i]
        lps = None
        if self._wants_lp(i):
            n = len(s.output_logprobs)  # the engine thread appends: read up to a fixed length
            lps, self.sent_lp[i] = s.output_logprobs[self.sent_lp[i]:n], n
        if not self.chat:
            lp = None if lps is None else self.fmt.completion(lps, offset=self.offset[i])
            self.offset[i] += sum(len(self.fmt.token(t.token_id)) for t in lps or [])
            return out + [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason}]
        content, calls = text, []
        parser = self.parsers[i]
        if parser is not None:
            content, calls = parser.feed(text)
            if finish_reason is not None:
                rest, more = parser.finish()
                content, calls = content + rest, calls + more
            if finish_reason == "stop" and parser.calls:
                finish_reason = "tool_calls"
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [c.as_openai(self.ncalls[i] + k) for k, c in enumerate(calls)]
            self.ncalls[i] += len(calls)
        if not delta and not lps and finish_reason is None:
            return out
        lp = None if lps is None else self.fmt.chat(lps)
        return out + [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]

    def empty(self, i: int) -> dict:
        """A chunk choice with no text (it carries an extension field only)."""
        if self.chat:
            return {"index": i, "delta": {}, "logprobs": None, "finish_reason": None}
        return {"index": i, "text": "", "logprobs": None, "finish_reason": None}

    def _echo_chunk(self, i: int) -> dict:
        """Completions with echo: the prompt (and its logprobs), sent before the choice's first text."""
        self.echoed[i] = True
        s = self.seqs[i]
        lp = None
        if self._wants_lp(i):
            lp = self.fmt.completion(list(s.prompt_logprobs), first=s.prompt_ids[0])
            self.offset[i] = sum(len(self.fmt.token(t)) for t in s.prompt_ids)
        return {"index": i, "text": self.prompt_text[i], "logprobs": lp, "finish_reason": None}
