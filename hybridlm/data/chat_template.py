"""A model's chat template, rendered as ``transformers``' ``apply_chat_template`` renders it, and
the loss mask of a conversation from prefix renderings.

The template is Jinja2 from the tokenizer directory (``chat_template.jinja``, else the
``chat_template`` entry of ``tokenizer_config.json``) or a ``--chat-template`` file. It runs in
Jinja2's immutable sandbox with the settings and helpers transformers gives it (trim_blocks,
lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not
escape HTML, ``{% generation %}`` blocks rendered as plain text), and sees the tokenizer's
special tokens (``bos_token``, ``eos_token``, ...) as variables. The rendered text is tokenized
without the tokenizer's own special tokens (``add_special_tokens=False``, as transformers does),
so a template that writes the BOS gets exactly one.

Which tokens are trained comes from renderings of prefixes of the conversation, not from
rendering each turn alone (a template may depend on the whole history): assistant turn ``i``
is the text between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i+1])``. That span holds the reply and its end-of-turn token and never the
role header, which belongs to the generation prompt. It is only meaningful when each prefix
rendering is a prefix of the next and of the whole conversation; a template that rewrites
earlier turns (e.g. drops past reasoning) is refused for the turns it rewrites.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from ..config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What defines how text becomes ids (a chat template or eos setting changes no id).
ENCODING_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


class TemplateError(ConfigError):
    """A chat template that cannot be used for training (the message names the file and why)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # where it came from, for messages
    text: str
    special_tokens: tuple  # ((name, token text), ...) passed to the template as variables

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False, tools=None) -> str:
        try:
            return _compile(self.text).render(messages=list(messages), tools=tools, documents=None,
                                              add_generation_prompt=add_generation_prompt, **dict(self.special_tokens))
        except Exception as e:  # noqa: BLE001 - jinja2's errors, raise_exception() in the template
            raise TemplateError(f"the chat template ({self.source}) failed to render: {type(e).__name__}: {e}") from None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}).") from None


def special_tokens(directory: str) -> tuple:
    """The tokenizer's special tokens as the template sees them ({name: text}), from
    tokenizer_config.json, then special_tokens_map.json (values may be AddedToken dicts)."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            config = _read_json(path)
            for key in SPECIAL_TOKEN_KEYS:
                value = config.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    found[key] = value
    return tuple(sorted(found.items()))


def load_template(tokenizer_dir: str, template_file: Optional[str] = None) -> ChatTemplate:
    """The template a run renders with: ``template_file`` (--chat-template), else the tokenizer's."""
    tokens = special_tokens(tokenizer_dir) if os.path.isdir(tokenizer_dir) else ()
    if template_file is not None:
        if not os.path.isfile(template_file):
            raise ConfigError(f"--chat-template {template_file}: no such file.")
        with open(template_file, encoding="utf-8") as f:
            return _checked(ChatTemplate(f"--chat-template {template_file}", f.read(), tokens))
    jinja = os.path.join(tokenizer_dir, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return _checked(ChatTemplate(jinja, f.read(), tokens))
    config_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    text = _read_json(config_path).get("chat_template") if os.path.isfile(config_path) else None
    if isinstance(text, list):  # [{"name": ..., "template": ...}]: the default one, as transformers picks
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--tokenizer-model {tokenizer_dir}: has no chat template (no {TEMPLATE_FILE}, no \"chat_template\" in "
                          "tokenizer_config.json); pass one with --chat-template FILE.")
    return _checked(ChatTemplate(f"{config_path} (chat_template)", text, tokens))


def _checked(template: ChatTemplate) -> ChatTemplate:
    try:
        _compile(template.text)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
        line = getattr(e, "lineno", None)
        raise TemplateError(f"{template.source}: not a valid Jinja2 template{f' (line {line})' if line else ''}: {e}.") from None
    return template


@lru_cache(maxsize=8)
def _compile(text: str):
    """The template compiled in the sandbox transformers uses (one per process and template)."""
    import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(text)


def encoding_sha256(tokenizer_path: str) -> str:
    """A hash of the files that decide how text becomes ids (not the template, not the config)."""
    digest = hashlib.sha256()
    if os.path.isfile(tokenizer_path):
        paths = [tokenizer_path]
    else:
        paths = [os.path.join(tokenizer_path, f) for f in ENCODING_FILES if os.path.isfile(os.path.join(tokenizer_path, f))]
    for path in paths:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


# ---------------------------------------------------------------- one conversation -> ids and mask

class NotPrefixConsistent(TemplateError):
    pass


def assistant_spans(template: ChatTemplate, messages: Sequence[dict], trained: Sequence[int], tools=None) -> tuple[str, list]:
    """(full rendering, [(start, end) character span of each trained assistant turn])."""
    full = template.render(messages, tools=tools)
    spans = []
    for i in trained:
        prompt = template.render(messages[:i], add_generation_prompt=True, tools=tools)
        turn = template.render(messages[: i + 1], tools=tools)
        if not (turn.startswith(prompt) and full.startswith(turn)):
            raise NotPrefixConsistent(
                f"the chat template ({template.source}) is not prefix-consistent at message {i + 1}: rendering the "
                "conversation up to a reply does not start with the rendering before it (with the generation prompt), "
                "or is not the start of the whole conversation's rendering, so the reply's tokens cannot be located; "
                "use --train-on last, or pass a --chat-template that renders earlier turns the same way.")
        spans.append((len(prompt), len(turn)))
    return full, spans


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token that starts inside a span: a token begun before it (a role header's last
    piece merged with the reply's first) stays out, the end-of-turn token inside it is in."""
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for begin, end in spans:
        mask[(starts >= begin) & (starts < end)] = 1
    return mask


def end_of_turn_id(template: ChatTemplate, tok) -> Optional[int]:
    """The special token that ends an assistant reply under ``template`` (``tok``: a
    ``tokenizers.Tokenizer``): the first special token after the reply in a rendered exchange,
    e.g. ChatML's <|im_end|> or Llama 3's <|eot_id|>. None when the reply ends in plain text."""
    reply = "ok"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
    try:
        full, [(start, end)] = assistant_spans(template, messages, [1])
    except TemplateError:
        return None
    after = full.find(reply, start) + len(reply)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    encoding = tok.encode(full, add_special_tokens=False)
    for token, (begin, _) in zip(encoding.ids, encoding.offsets):
        if after <= begin < end and token in special:
            return token
    return None
