"""A model's own chat template, rendered the way `transformers`' `apply_chat_template` does.

Chat rows must reach the model in exactly the text it was tuned on, so the template comes
from the model folder (``tokenizer_config.json``'s ``chat_template`` or a
``chat_template.jinja`` file) and is rendered with the same jinja2 set-up as transformers:
a sandboxed environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a JSON ``tojson`` and the ``bos_token``/``eos_token`` strings. Loss goes on
assistant turns only; their character spans come from ``{% generation %}`` blocks when the
template has them, else from rendering each conversation prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A chat template that does not render a conversation; the message says why."""


def _token_text(value: Any) -> str:
    """tokenizer_config.json writes special tokens as text or as an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def load_chat_template(model_dir: str | Path) -> "ChatTemplate | None":
    """The model's chat template, or None when its folder has none."""
    folder = Path(model_dir)
    config: dict[str, Any] = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"{cfg_path}: cannot read: {e}") from None
    source = None
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        source = jinja_path.read_text(encoding="utf-8")
    else:
        raw = config.get("chat_template")
        if isinstance(raw, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            raw = named.get("default")
        source = raw if isinstance(raw, str) and raw.strip() else None
    if source is None:
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


class _Tracker:
    """The chunks rendered so far and the ``{% generation %}`` spans found, during one render."""

    current: ContextVar[tuple | None] = ContextVar("plora_generation_spans", default=None)


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            state = _Tracker.current.get()
            if state is not None:  # the chunks rendered so far end where this block starts
                chunks, spans = state
                start = sum(len(c) for c in chunks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class Rendered:
    """A rendered conversation and the character spans ``[start, end)`` of its assistant turns."""

    text: str
    spans: list[tuple[int, int]]


class ChatTemplate:
    """One compiled chat template with the model's bos/eos token text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2

        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` gives it."""
        return self._render(messages, add_generation_prompt)[0]

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        chunks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _Tracker.current.set((chunks, spans))
        try:
            for chunk in self._template.generate(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token):
                chunks.append(chunk)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refuses this conversation: {e}") from None
        finally:
            _Tracker.current.reset(token)
        return "".join(chunks), spans

    def render_with_spans(self, messages: Sequence[dict]) -> Rendered:
        """The whole conversation and where each assistant turn's trained text lies in it.

        With ``{% generation %}`` blocks, those blocks are the spans (as transformers'
        ``return_assistant_tokens_mask``). Otherwise an assistant turn runs from the end of
        the conversation before it rendered with the generation prompt to the end of the
        conversation up to it: its content and whatever closes the turn (an end-of-turn
        token), so the model learns to stop.
        """
        text, blocks = self._render(messages, False)
        if self.has_generation_blocks and blocks:
            return Rendered(text, blocks)
        spans = []
        pos = 0
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if text.startswith(before) and text.startswith(upto) and len(upto) > len(before):
                start, end = len(before), len(upto)
            else:  # a template that renders a prefix differently: the content itself
                content = str(m.get("content", ""))
                start = text.find(content, pos)
                if start < 0:
                    raise ChatTemplateError(f"cannot find assistant turn {i} in the rendered conversation")
                end = start + len(content)
                if text.startswith(upto) and len(upto) > end:
                    end = len(upto)
            spans.append((start, end))
            pos = end
        return Rendered(text, spans)
