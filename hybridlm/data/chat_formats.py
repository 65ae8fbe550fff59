"""The JSONL shapes chat data comes in, read into one form: messages plus which replies to train.

Supervised (one conversation per line):

* ``{"messages": [{"role", "content", optional "loss": false}, ...], optional "tools"}`` (OpenAI /
  TRL / ms-swift; ``"loss": false`` leaves that assistant turn out of the loss, as ms-swift does);
* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value"}], optional "system"}``;
* Alpaca: ``{"instruction", optional "input", "output", optional "system"}`` (user = instruction,
  then a newline and the input when there is one).

Preference (a pair per line; chosen and rejected become two conversations sharing the prompt):

* ``{"prompt", "chosen", "rejected"}`` as strings (one user turn, one assistant reply each) or as
  message lists (TRL's conversational form); without ``"prompt"`` the shared leading messages of
  ``chosen`` and ``rejected`` are the prompt (TRL's implicit prompt);
* ``{"messages": [..., final assistant reply], "rejected_response": "..."}`` (ms-swift).

Prompts (GRPO; a prompt per line, the reply is sampled in training):

* ``{"prompt": "text"}`` (plain text, no chat template), ``{"prompt": [messages]}`` or
  ``{"messages": [messages]}`` (TRL's conversational form), ending before the reply: never with an
  assistant turn.

Only the reply turns of a pair are trained. Every problem is a ``LineError`` with a reason the
caller prefixes with ``file:line``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "chatgpt": "assistant", "system": "system", "tool": "tool", "observation": "tool", "function": "tool"}
# The roles of a "messages" list that chat templates know (OpenAI's, with Llama 3's ipython): any other
# is a typo whose turn a template would render as something else or drop, never train as a reply.
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


class LineError(ValueError):
    """What is wrong with one JSONL line (the caller adds the file and line)."""


@dataclass
class Conversation:
    messages: list  # dicts as the chat template sees them
    trained: list  # indices of the assistant turns in the loss
    tools: Optional[list] = None


@dataclass
class Pair:
    chosen: Conversation
    rejected: Conversation
    kind: str = field(default="preference", init=False)


def is_preference(obj: dict) -> bool:
    return ("chosen" in obj and "rejected" in obj) or "rejected_response" in obj


def _message(raw, where: str) -> dict:
    if not isinstance(raw, dict):
        raise LineError(f"{where} is a JSON {type(raw).__name__}, not an object")
    if not isinstance(raw.get("role"), str):
        raise LineError(f"{where} has no string 'role'")
    if raw["role"] not in MESSAGE_ROLES:
        meant = ROLES.get(raw["role"].lower())
        hint = f" (did you mean '{meant}'?)" if meant and meant != raw["role"] else ""
        raise LineError(f"{where} has the unknown role '{raw['role']}'{hint}; the roles are {', '.join(MESSAGE_ROLES)}")
    content = raw.get("content")
    if content is not None and not isinstance(content, str):
        raise LineError(f"{where} has non-text 'content' (a JSON {type(content).__name__}); only text is supported")
    if "loss" in raw and not isinstance(raw["loss"], (bool, type(None))):
        raise LineError(f"{where} has a 'loss' that is not true, false or null")
    return {k: v for k, v in raw.items() if v is not None}  # as transformers drops None values


def _messages(raw, key: str) -> list:
    if not isinstance(raw, list) or not raw:
        raise LineError(f"'{key}' is not a non-empty list of messages")
    return [_message(m, f"{key}[{i}]") for i, m in enumerate(raw)]


def _trained(messages: list, train_on: str, first: int = 0) -> list:
    """Indices of assistant turns from ``first`` on, minus those marked ``"loss": false``."""
    for i, m in enumerate(messages):
        if m.get("loss") is True and m["role"] != "assistant":
            raise LineError(f"message {i + 1} has \"loss\": true but role '{m['role']}'; only assistant turns are trained")
    turns = [i for i, m in enumerate(messages) if i >= first and m["role"] == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    return [i for i in turns if messages[i].get("loss", True) is not False]


def _strip(messages: list) -> list:
    return [{k: v for k, v in m.items() if k != "loss"} for m in messages]


def _tools(obj: dict):
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise LineError("'tools' is not a list")
    return tools


def read_conversation(obj: dict, train_on: str = "all") -> Conversation:
    """A supervised line -> Conversation."""
    if "messages" in obj:
        messages = _messages(obj["messages"], "messages")
    elif "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise LineError("'conversations' is not a non-empty list")
        messages = []
        if isinstance(obj.get("system"), str) and obj["system"]:
            messages.append({"role": "system", "content": obj["system"]})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise LineError(f"conversations[{i}] has no string 'value'")
            role = ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise LineError(f"conversations[{i}] has 'from': {turn.get('from')!r}; known: {', '.join(sorted(ROLES))}")
            messages.append({"role": role, "content": turn["value"], **({"loss": turn["loss"]} if "loss" in turn else {})})
    elif "instruction" in obj and "output" in obj:
        for key in ("instruction", "output", "input", "system"):
            if key in obj and obj[key] is not None and not isinstance(obj[key], str):
                raise LineError(f"'{key}' is not a string")
        user = obj["instruction"] + (f"\n{obj['input']}" if obj.get("input") else "")
        messages = ([{"role": "system", "content": obj["system"]}] if obj.get("system") else []) + \
                   [{"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]
    else:
        raise LineError("no 'messages', 'conversations' or 'instruction'/'output' (and no preference pair)")
    return Conversation(_strip(messages), _trained(messages, train_on), _tools(obj))


def _side(value, key: str) -> list:
    """A chosen/rejected value: a string (one assistant reply) or a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return _messages(value, key)


def read_pair(obj: dict) -> Pair:
    """A preference line -> Pair (the replies after the shared prompt are trained)."""
    tools = _tools(obj)
    if "rejected_response" in obj:
        messages = _messages(obj.get("messages"), "messages")
        if messages[-1]["role"] != "assistant":
            raise LineError("'messages' must end with the chosen assistant reply when 'rejected_response' is given")
        if not isinstance(obj["rejected_response"], str):
            raise LineError("'rejected_response' is not a string")
        prompt, chosen, rejected = messages[:-1], messages[-1:], [{"role": "assistant", "content": obj["rejected_response"]}]
    elif "prompt" in obj:
        raw = obj["prompt"]
        prompt = [{"role": "user", "content": raw}] if isinstance(raw, str) else _messages(raw, "prompt")
        chosen, rejected = _side(obj["chosen"], "chosen"), _side(obj["rejected"], "rejected")
    else:  # implicit prompt: the messages chosen and rejected share
        chosen, rejected = _messages(obj["chosen"], "chosen"), _messages(obj["rejected"], "rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if not prompt:
        raise LineError("the pair has no prompt")

    def conversation(reply: list) -> Conversation:
        messages = prompt + reply
        return Conversation(_strip(messages), _trained(messages, "all", first=len(prompt)), tools)
    return Pair(conversation(chosen), conversation(rejected))


def read_prompt(obj: dict) -> tuple[str, object, Optional[list]]:
    """A prompt line -> (its key, the prompt as given with messages checked, its messages or None for plain text)."""
    key = "messages" if "messages" in obj else "prompt" if "prompt" in obj else None
    if key is None:
        raise LineError("no 'prompt' (text or messages) and no 'messages'")
    raw = obj[key]
    if key == "prompt" and isinstance(raw, str):
        if not raw:
            raise LineError("'prompt' is empty")
        return key, raw, None
    messages = _strip(_messages(raw, key))
    if messages[-1]["role"] == "assistant":
        raise LineError(f"'{key}' ends with an assistant reply; a prompt ends where the reply to be sampled begins")
    return key, messages, messages
