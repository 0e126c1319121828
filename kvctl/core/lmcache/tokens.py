"""Prompt inputs to token ids, the way vLLM tokenizes the same request.

A completion prompt is tokenized with special tokens (the BOS a model's post-processor adds); a
chat is rendered with the model's chat template (with the generation prompt) and tokenized without
adding special tokens again, as vLLM's chat path does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.core.errors import KvctlError, UsageError

MAX_INPUT_BYTES = 64 * 1024 * 1024  # a prompt this large is ~16M tokens: beyond any context window


def read_input_bytes(path: str) -> bytes:
    """The whole file (or standard input for '-'), refusing what cannot be a prompt."""
    name = "standard input" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
        else:
            if Path(path).is_dir():
                raise KvctlError(f"{path} is a directory, not a prompt file", hint="give a text file, or - for stdin")
            with open(path, "rb") as handle:
                data = handle.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise KvctlError(f"no such file: {path}", hint="check the path; use - to read standard input") from None
    except PermissionError:
        raise KvctlError(f"cannot read {path}: permission denied", hint="check the file's permissions") from None
    if len(data) > MAX_INPUT_BYTES:
        raise KvctlError(f"{name} is larger than {MAX_INPUT_BYTES // 2**20} MiB",
                         hint="no model takes a prompt that long; split it")
    if not data.strip():
        raise KvctlError(f"{name} is empty", hint="a prompt needs at least one token")
    if b"\0" in data:
        raise KvctlError(f"{name} is binary, not text", hint="give a UTF-8 text file")
    return data


def read_text(path: str) -> str:
    data = read_input_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise KvctlError(f"{path} is not UTF-8 text (byte {error.start})", hint="convert it to UTF-8") from None


def read_json(path: str, shape_hint: str) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise KvctlError(f"{path} is not valid JSON (line {error.lineno}): {error.msg}", hint=shape_hint) from None
    except ValueError as error:  # past JSONDecodeError: an integer of more than 4300 digits
        raise KvctlError(f"{path} is not usable JSON: {str(error).split(';')[0]}", hint=shape_hint) from None
    except RecursionError:
        raise KvctlError(f"{path} is not valid JSON: it nests deeper than Python parses", hint=shape_hint) from None


def read_chat(path: str) -> list[dict[str, Any]]:
    messages = read_json(path, 'a chat file is a JSON list of {"role": …, "content": …} messages')
    if not isinstance(messages, list) or not messages or not all(
            isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message
            for message in messages):
        raise KvctlError(f"{path} is not a list of chat messages",
                         hint='write [{"role": "system", "content": "…"}, {"role": "user", "content": "…"}]')
    return messages


def read_token_ids(path: str) -> list[int]:
    tokens = read_json(path, "a tokens file is a JSON list of token ids, e.g. [1, 415, 2936]")
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in tokens):
        raise KvctlError(f"{path} is not a non-empty JSON list of token ids",
                         hint="write the ids as a JSON list of non-negative integers")
    return tokens


_LOADING = threading.Lock()


class LocalTokenizer:
    """The model directory's own tokenizer, loaded offline with transformers (as vLLM loads it)."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        directory = Path(model_dir)
        if not directory.is_dir():
            raise UsageError(f"{model_dir} is not a model directory", hint="give --model a local model directory, "
                             "use --tokens-file, or point kvctl at the running vLLM")
        if not any((directory / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise KvctlError(f"{model_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                             hint="use --tokens-file, or a model directory that has its tokenizer")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        with _LOADING:  # a fleet's members tokenize on threads; transformers' lazy import is not thread-safe
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            except Exception as error:  # noqa: BLE001 - transformers raises many kinds
                raise KvctlError(f"cannot load the tokenizer of {model_dir}: {str(error).splitlines()[0]}",
                                 hint="check the model directory, or use --tokens-file") from None

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise KvctlError("the model has no chat template", hint="use --prompt-file with the rendered prompt")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class PromptSource:
    """A prompt as the user gave it: exactly one of a text file, a chat file, or a token-ids file."""

    prompt_file: str | None = None
    chat: str | None = None
    tokens_file: str | None = None

    @property
    def given(self) -> bool:
        return bool(self.prompt_file or self.chat or self.tokens_file)

    def token_ids(self, model_dir: str | None, vllm_url: str | None = None, model: str | None = None) -> list[int]:
        """Tokenized as vLLM would: by the running vLLM when its URL is given, else by the local tokenizer
        of `model_dir`; a token-ids file needs neither."""
        given = [name for name, value in (("--prompt-file", self.prompt_file), ("--chat", self.chat),
                                          ("--tokens-file", self.tokens_file)) if value]
        if len(given) != 1:
            raise UsageError("give exactly one of --prompt-file, --chat, --tokens-file",
                             hint="e.g. kvctl lookup --prompt-file prompt.txt --config DIR --model MODEL")
        if self.tokens_file:
            return read_token_ids(self.tokens_file)
        if vllm_url:
            from kvctl.clients.vllm import VLLMClient

            with VLLMClient(vllm_url) as vllm:
                name = model or vllm.models()[0]
                if self.chat:
                    return vllm.tokenize(name, messages=read_chat(self.chat))
                return vllm.tokenize(name, prompt=read_text(self.prompt_file))
        if model_dir is None:
            raise UsageError("tokenizing a prompt needs the model's tokenizer",
                             hint="pass --model with a local model directory, or --tokens-file")
        tokenizer = LocalTokenizer(model_dir)
        return tokenizer.encode_chat(read_chat(self.chat)) if self.chat else tokenizer.encode_prompt(
            read_text(self.prompt_file))


def local_model_dir(*candidates: str | None) -> str | None:
    """The first candidate model name that is a local directory (it holds the tokenizer)."""
    return next((name for name in candidates if name and Path(name).is_dir()), None)
