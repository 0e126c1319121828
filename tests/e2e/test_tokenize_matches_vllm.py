"""kvctl tokenizes prompts and chats exactly as a real vLLM does for the same request."""

import json

import httpx
import pytest

from kvctl.core.lmcache.tokens import LocalTokenizer
from tests.helpers import free_port, start_vllm, stop_process, wait_until

PROMPT = "def greet(name):\n    return f'Hello, {name}!'  # ünïcödé too\n" * 20
CHAT = [{"role": "system", "content": "You answer in Python."}, {"role": "user", "content": "Sort a list."}]


@pytest.mark.slow
def test_token_ids_equal_vllm_tokenize(tiny_model, tmp_path):
    port = free_port()
    log = tmp_path / "vllm.log"
    proc = start_vllm(tiny_model, log, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 300, "vLLM", proc, log)
        tokenizer = LocalTokenizer(tiny_model)
        served = httpx.post(f"{url}/tokenize", json={"model": str(tiny_model), "prompt": PROMPT}, timeout=30).json()
        assert served["tokens"] == tokenizer.encode_prompt(PROMPT)
        assert served["tokens"][0] == tokenizer.tokenizer.bos_token_id
        chat = httpx.post(f"{url}/tokenize", json={"model": str(tiny_model), "messages": CHAT}, timeout=30).json()
        assert chat["tokens"] == tokenizer.encode_chat(CHAT)
        assert json.dumps(chat["tokens"]) != json.dumps(served["tokens"])
    finally:
        stop_process(proc, grace=20)
