"""The chunk routes (chunks/read, chunks/write) against hostile and greedy clients, on a real standalone
engine: a malformed frame is a 400, never a 500; at most routes.MAX_CHUNK_TRANSFERS requests are served
at once and the next is a 503 busy; read answers stream; the engine goes on serving."""

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from kvctl_plugins.routes import MAX_CHUNK_TRANSFERS
from kvctl_plugins.wire import FRAME_LENGTH, FRAMES_TYPE, NEXT_HEADER, PREFIX, read_frames

from kvctl.clients.internal_api import InternalAPIClient
from kvctl.core.errors import ServerError
from kvctl.core.lmcache.keys import KeyRecipe, inprocess_keys
from tests.helpers import http_client, http_json, run_kvctl, standalone_engine, wait_until

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 2  # kv, layers, tokens, heads x head size, float16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk-limits")
    with standalone_engine(root, "--tier", "cpu:0.1") as url:
        yield url


def serving(url):
    return http_client().get(f"{url}{PREFIX}/info", timeout=10).status_code == 200


def stored(url, start, chunks):
    """Store a prompt of `chunks` chunks on the engine's CPU tier (LMCache's mock GPU connector): its keys."""
    http_json("POST", f"{url}/cache/store", params={"tokens_mock": f"{start},{start + chunks * CHUNK}"})
    keys = inprocess_keys(list(range(start, start + chunks * CHUNK)),
                          KeyRecipe("tiny", CHUNK, "sha256_cbor", "0", kv_dtype="half"))
    with InternalAPIClient(url) as client:
        wait_until(lambda: {e["key"] for e in client.keys("cpu", limit=10000)["keys"]} >= set(keys), 30, "stored")
    return keys


def write(url, body: bytes, **headers):
    return http_client().post(f"{url}{PREFIX}/chunks/write", content=body,
                              headers={"Content-Type": FRAMES_TYPE, **headers}, timeout=30)


def held_open(url):
    """A chunks/write whose body never finishes: it holds one of the engine's chunk transfers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=10)
    connection.sendall(f"POST {PREFIX}/chunks/write HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {FRAMES_TYPE}\r\n"
                       "Content-Length: 1000000\r\n\r\nsome".encode())
    return connection


@pytest.mark.slow
def test_a_frame_header_nested_past_the_stack_is_a_400(engine):
    header = b"[" * 8000  # under the 8 KiB header cap; json.loads raised RecursionError: a 500
    refused = write(engine, FRAME_LENGTH.pack(len(header)) + header)
    assert refused.status_code == 400, refused.text
    assert refused.json() == {"error": "bad_request", "message": "the body is not chunk frames: a frame header at "
                                                                 "byte 4 is not {key, size, metadata}"}
    assert serving(engine)


@pytest.mark.slow
def test_chunk_requests_beyond_the_bound_are_refused_busy_and_the_engine_stays_healthy(engine, tmp_path):
    keys = stored(engine, 0, 3)
    prompt = tmp_path / "tokens.json"
    prompt.write_text(json.dumps(list(range(3 * CHUNK))))
    held = [held_open(engine) for _ in range(MAX_CHUNK_TRANSFERS)]
    try:
        wait_until(lambda: write(engine, b"").status_code == 503, 10, "the held requests admitted")
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: write(engine, b"x" * 100_000), range(8)))
        assert {answer.status_code for answer in answers} == {503}
        assert answers[0].json()["error"] == "busy" and answers[0].headers["Retry-After"] == "5"
        assert "\n" not in answers[0].json()["message"]
        assert serving(engine)  # the other routes are not bounded
        with InternalAPIClient(engine) as client:
            for call in (lambda: client.read_chunks(keys), lambda: client.write_chunks(b"")):
                with pytest.raises(ServerError, match="is busy: this engine is already moving chunk bytes") as busy:
                    call()
                assert "retry when it has finished" in busy.value.hint
        saved = run_kvctl("snapshot", "save", "--tokens-file", prompt, "--instance", engine, "-o", tmp_path / "s")
        assert saved.code == 5 and "is busy" in saved.stderr and "hint: " in saved.stderr, saved.stderr
        assert "Traceback" not in saved.stderr and len(saved.stderr.strip().splitlines()) == 2
    finally:
        for connection in held:
            connection.close()
    # the held requests' clients went away mid-body: their transfers are given back
    wait_until(lambda: write(engine, b"").status_code == 400, 10, "the transfers given back")
    with InternalAPIClient(engine) as client:
        body, rest = client.read_chunks(keys)
    assert [key for key, _, _ in read_frames(body)] == keys and rest == []


@pytest.mark.slow
def test_a_body_over_the_cap_is_refused_unread_and_gives_its_transfer_back(engine):
    for _ in range(MAX_CHUNK_TRANSFERS + 1):
        with socket.create_connection(("127.0.0.1", int(engine.rsplit(":", 1)[1])), timeout=10) as connection:
            connection.sendall(f"POST {PREFIX}/chunks/write HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                               f"{FRAMES_TYPE}\r\nContent-Length: 300000000\r\n\r\n".encode())
            assert connection.recv(4096).startswith(b"HTTP/1.1 413")  # no byte of the body sent
    assert write(engine, b"").status_code == 400 and serving(engine)


@pytest.mark.slow
def test_a_read_answer_streams_chunk_by_chunk(engine):
    keys = stored(engine, 100_000, 4)
    with httpx.stream("POST", f"{engine}{PREFIX}/chunks/read", json={"keys": [*keys, keys[0]]}, timeout=30) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"] == FRAMES_TYPE
        assert "content-length" not in answer.headers and answer.headers["transfer-encoding"] == "chunked"
        assert NEXT_HEADER not in answer.headers
        body = answer.read()
    frames = list(read_frames(body))
    assert [key for key, _, _ in frames] == keys and all(len(data) == CHUNK_BYTES for _, data, _ in frames)
