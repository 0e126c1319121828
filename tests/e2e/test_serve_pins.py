"""`kvctl serve --pins FILE` on the embedded default: once every part is ready, the pin set is applied, its
prompt first prefilled through vLLM (nothing was cached), then pinned whole, under the set's id."""

import json

import pytest

from tests.e2e.test_serve import Serve, prompt_file
from tests.helpers import wait_until


@pytest.mark.slow
def test_serve_prefills_and_pins_its_pin_set_once_ready(tmp_path, tiny_model):
    prompt = prompt_file(tmp_path)
    pins = tmp_path / "pins.yaml"
    pins.write_text(f"name: boot\npins:\n  - prompt_file: {prompt.name}\n    ttl: 1h\n")
    serve = Serve(tmp_path / "kvctl-cache", "--pins", pins, model=tiny_model)
    try:
        def listed():
            result = serve.kvctl("pins", "--format", "json")
            return result.code == 0 and json.loads(result.stdout)["pins"]

        (pin,) = wait_until(listed, 120, "the pin set applied")
        assert pin["set"] == "boot" and pin["pin_id"].startswith("set-boot-") and pin["chunks"] >= 2
        assert pin["pinned"] == {"cpu": pin["chunks"], "disk": pin["chunks"]}  # prefilled, then pinned whole
        assert 3500 < pin["ttl_remaining_s"] <= 3600
        wait_until(lambda: "pin set boot: 1 pin" in serve.stderr.read_text(), 30, "the pin set reported")
        again = serve.kvctl("pin", "apply", pins, "--format", "json")
        assert again.code == 0, again.stderr
        (step,) = json.loads(again.stdout)["steps"]
        assert (step["action"], step["pin_id"], step["prewarm"]) == ("refresh", pin["pin_id"], None)
        assert serve.stop() == 0
    finally:
        if serve.proc.poll() is None:
            serve.stop()
    serve.assert_nothing_left()
