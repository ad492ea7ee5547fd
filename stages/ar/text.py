"""Text in and out of an autoregressive stage.

- `TextTokenizer`: tokenizer (tokenizer.json through the `tokenizers` library) and chat
  template (jinja, from chat_template.jinja / tokenizer_config.json) of a Hugging Face
  checkpoint directory, without importing transformers.
- `IncrementalDetokenizer`: turns a growing token list into text deltas that never end in a
  broken UTF-8 sequence (byte-level BPE splits multi-byte characters across tokens); the
  deltas concatenate to exactly `decode(all tokens)`.
- `StopStringMatcher`: cuts stop strings out of a text stream, including ones that span
  token boundaries, holding back any tail that may still become a stop string.
- `OutputText`: the two together, one per generated sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from omnistage.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
# Chat roles the checkpoints' templates render (OpenAI's names); any other is refused.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_text(text: str, param: str) -> None:
    """Refuse a string that is not valid Unicode (a lone surrogate such as "\\ud800"): it
    cannot be encoded as UTF-8, so no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}", param=param
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Tokenizer, special tokens and chat template of one checkpoint directory."""

    def __init__(self, tokenizer, config: dict[str, Any], chat_template: str | None, eos_token_ids: list[int]):
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more of a text (byte-level
        vocabularies spell each byte as one character, so this is also the bytes bound)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def max_chars(self, num_tokens: int) -> int:
        """A text longer than this cannot encode to num_tokens tokens or fewer. Slack of 4x:
        a Unicode normalizer may compose characters (3 Hangul jamo -> 1 syllable) first."""
        return num_tokens * self.max_token_chars * 4

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TextTokenizer:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        elif (model_dir / "chat_template.json").is_file():
            template = _read_json(model_dir / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos_ids = _eos_ids(model_dir, tokenizer, config)
        return cls(tokenizer, config, template, eos_ids)

    @staticmethod
    def available(model_dir: str | Path | None) -> bool:
        return model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file()

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a prompt instead", param="messages")
        messages = validate_messages(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        special = {
            key: _token_content(self.config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in special.items() if v is not None},
            **extra,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # Like transformers: the template already places any special tokens itself.
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _eos_ids(model_dir: Path, tokenizer, tok_config: dict[str, Any]) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        if value is not None:
            return [value] if isinstance(value, int) else [int(v) for v in value]
    eos = _token_content(tok_config.get("eos_token"))
    tid = tokenizer.token_to_id(eos) if eos else None
    return [tid] if tid is not None else []


def _compile_template(source: str):
    """Jinja environment with the helpers chat templates expect (as transformers provides)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages; text-only content part lists are joined into a string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] needs a string 'role'", param="messages")
        if msg["role"] not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {msg['role'][:40]!r}",
                param="messages",
            )
        content = msg.get("content", "")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    raise InvalidRequestError(
                        f"messages[{i}]: only text content parts are accepted here", param="messages"
                    )
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
        check_text(content, "messages")
        out.append({**msg, "content": content})
    return out


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence.

    Decodes a small window: `prefix_offset..read_offset` is text already emitted, used as
    context (so decoders that depend on the previous token, like Metaspace, stay right), and
    `read_offset..` are tokens whose text is not out yet. A delta is released only when the
    window's text no longer ends in U+FFFD, i.e. the last character's bytes are complete.
    Each release moves both offsets to a clean character boundary, so the deltas add up to
    `decode(all tokens)`; `flush()` releases whatever is held at the end of the sequence.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything released so far

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        ids = self.token_ids
        prefix = decode(ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(ids[self.prefix_offset :], self.skip_special_tokens)
        return prefix, full

    def push(self, new_ids: Iterable[int]) -> str:
        self.token_ids.extend(int(t) for t in new_ids)
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix, full = self._window()
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    Any tail of the text that is a proper prefix of some stop string is held back, so an
    occurrence can only start inside the held text or the new delta: nothing that may turn
    out to be part of a stop string is ever released.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to release, whether a stop string was found). After a stop: ("", True)."""
        if self.stopped:
            return "", True
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text, False
        cut = -1
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut != -1:
            self.held = ""
            self.stopped = True
            return text[:cut], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self.held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; the sequence should finish with reason "stop"


class OutputText:
    """Detokenizer plus stop strings for one generated sequence."""

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str] = (), skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.matcher = StopStringMatcher(stops)
        self.text = ""  # released text (stop strings cut)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, new_ids: Iterable[int]) -> TextDelta:
        out, stopped = self.matcher.push(self.detok.push(new_ids))
        self.text += out
        return TextDelta(out, stopped)

    def finish(self) -> TextDelta:
        """Release everything still held (the sequence ended for another reason)."""
        out, stopped = self.matcher.push(self.detok.flush())
        if not stopped:
            out += self.matcher.flush()
        self.text += out
        return TextDelta(out, stopped)


def normalize_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
