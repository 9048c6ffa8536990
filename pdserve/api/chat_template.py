"""A model's chat template: `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`,
rendered with jinja2 as Hugging Face transformers renders it.

transformers compiles the template in an immutable sandbox (templates come with downloaded
models) with `trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension, adds
`raise_exception`, `strftime_now` and a `tojson` filter taking json.dumps' arguments (Kimi's
template calls `tojson(separators=...)`), and renders with `messages`, `tools`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...). The same here,
so a template renders the text the model was trained on. The `{% generation %}` tag of
transformers' assistant-mask extension is not supported (a template using it fails to compile,
naming the tag).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

Message = dict  # {"role", "content"} and optionally "name", "tool_calls", "tool_call_id"

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def simple_chat_template(messages: list[Message], tools: list[dict] | None = None) -> str:
    """The documented template for models without one: "<|role|>\\ncontent\\n" per message,
    then "<|assistant|>\\n" to prompt the reply. Tools and tool calls are JSON lines
    (`json.dumps`, non-ASCII kept): readable, and the same text for the same request.
    - `tools`, when given, come first: "<|tools|>\\n" and one line per tool;
    - an assistant message's `tool_calls` follow its content (a line of its own, left out when
      the content is empty) as one line `{"tool_calls": [...]}`;
    - a tool result (role "tool") is "<|tool|>\\ncontent\\n", like any message."""
    head = ("<|tools|>\n" + "".join(map(_json_line, tools))) if tools else ""
    return head + "".join(map(_simple_turn, messages)) + "<|assistant|>\n"


def _simple_turn(m: Message) -> str:
    if not m.get("tool_calls"):
        return f"<|{m['role']}|>\n{m['content']}\n"
    content = f"{m['content']}\n" if m["content"] else ""
    return f"<|{m['role']}|>\n{content}" + _json_line({"tool_calls": m["tool_calls"]})


def _json_line(x) -> str:
    return json.dumps(x, ensure_ascii=False) + "\n"


def special_text(token) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with."""

    def __init__(self, source: str, specials: dict[str, str], where: str):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"{where}: the chat template does not compile: {exc}") from None
        self.specials = specials

    def render(self, messages: list[Message], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text; a template that refuses the messages is a ValueError."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.specials)
        except TemplateError as exc:
            raise ValueError(f"the chat template refused them: {exc}") from None


def load_chat_template(directory: Path, config: dict) -> ChatTemplate | None:
    """The directory's template: `chat_template.jinja` when present (it takes precedence, as in
    transformers), else `config["chat_template"]` (a string, or named templates of which
    "default" is used); None when there is neither."""
    path = directory / TEMPLATE_FILE
    if path.exists():
        source, where = path.read_text(), str(path)
    else:
        source, where = config.get("chat_template"), f"{directory}/tokenizer_config.json"
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    specials = {k: text for k in SPECIAL_KEYS if (text := special_text(config.get(k)))}
    return ChatTemplate(source, specials, where)
