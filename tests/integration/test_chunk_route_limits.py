"""The chunk routes (chunks/read, chunks/write) against hostile and greedy clients, on a real standalone
engine: a malformed frame is a 400, never a 500, and the engine goes on serving."""

import httpx
import pytest
from kvctl_plugins.wire import FRAME_LENGTH, FRAMES_TYPE, PREFIX

from tests.helpers import standalone_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk-limits")
    with standalone_engine(root, "--tier", "cpu:0.1") as url:
        yield url


def serving(url):
    return httpx.get(f"{url}{PREFIX}/info", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_frame_header_nested_past_the_stack_is_a_400(engine):
    header = b"[" * 8000  # under the 8 KiB header cap; json.loads raised RecursionError: a 500
    refused = httpx.post(f"{engine}{PREFIX}/chunks/write", content=FRAME_LENGTH.pack(len(header)) + header,
                         headers={"Content-Type": FRAMES_TYPE}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json() == {"error": "bad_request", "message": "the body is not chunk frames: a frame header at "
                                                                 "byte 4 is not {key, size, metadata}"}
    assert serving(engine)
