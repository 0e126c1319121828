"""The project's tiny offline model: a byte-level BPE tokenizer trained on Python's own standard
library and a random-weight Llama small enough for vLLM's CPU backend. No hub access, deterministic.

head_dim is 32, the smallest head size vLLM's CPU attention supports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

# Modules of the standard library that every CPython 3.11 ships, in a fixed order.
CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "colorsys", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "imaplib", "inspect", "ipaddress", "keyword", "linecache", "locale", "mailbox", "mimetypes", "netrc",
    "numbers", "operator", "optparse", "pathlib", "pickle", "platform", "pprint", "queue", "random", "re",
    "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "typing", "uuid", "warnings",
    "weakref", "zipfile",
)
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MARKER = "kvctl-tiny-model"  # says "this is kvctl's tiny model" to kvctl serve, wherever the directory is
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", MARKER)


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / f"{name}.py" for name in CORPUS_MODULES if (stdlib / f"{name}.py").is_file()]


def build_tokenizer(save_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in corpus_files()]
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(save_dir)
    return fast


def build_model(save_dir: Path, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(save_dir, safe_serialization=True)


def build_tiny_model(target: Path, force: bool = False) -> Path:
    """Build into `target` (atomically: a temporary sibling directory, then a rename)."""
    if target.exists() and not force and all((target / name).exists() for name in MODEL_FILES):
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = build_tokenizer(staging)
        build_model(staging, tokenizer)
        (staging / MARKER).write_text("built by `kvctl model tiny`: random weights, for trying kvctl\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_tiny_model(model: str) -> bool:
    """Whether vLLM's --model names a directory kvctl's tiny model builder made."""
    return (Path(model) / MARKER).is_file()


def model_digest(directory: Path) -> str:
    """One SHA-256 over the model's files, to compare builds."""
    digest = hashlib.sha256()
    for name in sorted(path.name for path in directory.iterdir() if path.is_file()):
        digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return digest.hexdigest()
