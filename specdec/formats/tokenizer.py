"""Text <-> token ids: the model directory's fast tokenizer, its chat template, and streaming."""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from specdec.errors import SpecdecError


class Tokenizer:
    """A transformers fast tokenizer loaded from a model directory (see hub.resolve_model); ``source``: what
    messages name as its model (a GGUF file, whose tokenizer files ``formats.gguf_model.model_files`` wrote and
    keeps per file).

    A GGUF file's tokenizer.json is loaded as written, by transformers' generic fast backend
    (``PreTrainedTokenizerFast``): those files state the file's whole pipeline, and a model's own class (which
    ``AutoTokenizer`` picks) rebuilds it from the vocabulary and merges in Python, 0.6 s against 2.3 s in a new
    process for Qwen2.5's 151,936 tokens (2.0 s against 3.1-3.9 s for Gemma 3's 262,144), with the same ids,
    texts and templates (tests/formats/test_gguf_in_place.py; the real files in tests/test_real_models.py). A model
    directory from elsewhere keeps ``AutoTokenizer``, its class's behaviour included."""

    def __init__(self, model_dir: str | Path, source: str | Path | None = None) -> None:
        import transformers

        self.model_dir = Path(model_dir)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        gguf = source is not None and str(source).lower().endswith(".gguf")
        try:
            load = transformers.PreTrainedTokenizerFast if gguf else transformers.AutoTokenizer
            self.hf = load.from_pretrained(str(self.model_dir))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpecdecError(f"could not load a tokenizer from {self.model_dir} "
                               f"({' '.join(str(e).split())}): the directory needs tokenizer.json and "
                               "tokenizer_config.json; convert the model again") from e
        finally:
            transformers.logging.set_verbosity(verbosity)
        if not getattr(self.hf, "is_fast", True):
            raise SpecdecError(f"the tokenizer in {self.model_dir} is not a fast (tokenizer.json) "
                               "tokenizer: save it with tokenizers/transformers as tokenizer.json")
        self.eos_token_ids: set[int] = set(_config_eos_ids(self.model_dir))
        if self.hf.eos_token_id is not None:
            self.eos_token_ids.add(int(self.hf.eos_token_id))
        self.eos_token_ids |= self._turn_ends()
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.model_dir = Path(source) if source is not None else self.model_dir

    def copy(self) -> "Tokenizer":
        """The same tokenizer as a separate object (a fast tokenizer must not serve two threads at once)."""
        other = copy.copy(self)
        other.hf, other.eos_token_ids = copy.deepcopy(self.hf), set(self.eos_token_ids)
        return other

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer can produce (added tokens included).

        This may be less than the model's embedding rows (Qwen pads 151,665 to 151,936).
        """
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja text (None: the model has none)."""
        t = self.hf.chat_template
        return t if isinstance(t, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is added only if the model's tokenizer adds it."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _turn_ends(self) -> set[int]:
        """The end-of-turn tokens the chat template writes (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``,
        ``<|end|>``...): a chat reply stops at them even where the config names another EOS."""
        template = self.chat_template or ""
        vocab = self.hf.get_vocab()
        return {vocab[t] for t in TURN_ENDS if t in vocab and t in template}

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for a reply.

        ``tools``: OpenAI-style function definitions, which the template shows the model (and
        messages may carry ``tool_calls`` / role ``tool`` results, as the template renders them).
        ``template_kwargs``: the template's own switches (vLLM's and transformers' ``chat_template_kwargs``),
        e.g. ``{"enable_thinking": False}`` for Qwen3."""
        if template_kwargs is not None and not (isinstance(template_kwargs, dict)
                                                and all(isinstance(k, str) for k in template_kwargs)):
            raise SpecdecError("chat_template_kwargs must be an object of named values, e.g. {\"enable_thinking\": false}")
        reserved = {"messages", "tools", "add_generation_prompt", "tokenize"} & set(template_kwargs or {})
        if reserved:
            raise SpecdecError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        if not self.has_chat_template:
            raise SpecdecError(f"the model in {self.model_dir} has no chat template: send a plain "
                               "text prompt (completion) instead of chat messages, or use an "
                               "instruct model")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise SpecdecError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        try:
            text = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                               **(template_kwargs or {}))
        except Exception as e:  # jinja2 raises TemplateError subclasses from the template's code
            raise SpecdecError(f"the chat template rejected these messages "
                               f"({' '.join(str(e).split())}): fix the message roles/order") from e
        # The template writes any BOS itself (as transformers does when tokenizing a chat).
        return self.encode(text, add_special_tokens=False)


# end-of-turn markers of the families' chat templates (ChatML, Gemma, Llama 3, Phi-3/4, SmolLM3, Granite, OLMo 2)
TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|end_of_text|>")


def _config_eos_ids(model_dir: Path) -> list[int]:
    """eos_token_id from config.json and generation_config.json, if present."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            eos = json.loads((model_dir / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids.extend(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never emitting half a character.

    A character may span several byte-level tokens; decoding those alone gives U+FFFD. We decode a
    short window of recent ids twice, with and without the new ones, and emit the difference only
    once it no longer ends in U+FFFD (the scheme of TGI and vLLM). Decoding with context also keeps
    the leading spaces that sentencepiece tokenizers drop from a lone token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-4:])  # a little context from the prompt
        self._prefix = 0  # ids[prefix:read] were already emitted, kept as context
        self._read = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text

    def feed(self, ids: Iterable[int]) -> str:
        """Add new token ids; return the newly completed text (maybe "")."""
        self._ids.extend(int(i) for i in ids)
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or a skipped special token): wait for more
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: emit whatever is left, replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)
