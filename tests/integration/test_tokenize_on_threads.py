"""A fleet's members tokenize on threads of one kvctl process (every `--instance all` or
`controller://` lookup, pin and snapshot with a local tokenizer). transformers' lazy import is not
thread-safe: found by the two-node controller e2e, where one member failed with "cannot import name
'AutoTokenizer'". Eight threads in a fresh interpreter load the tokenizer at once."""

import subprocess
import sys

from tests.helpers import REPO

SCRIPT = """
import sys, threading
sys.path.insert(0, {repo!r})
from kvctl.core.lmcache.tokens import LocalTokenizer
errors = []

def load():
    try:
        LocalTokenizer({model!r}).encode_prompt("hello fleet")
    except Exception as error:
        errors.append(repr(error)[:200])

threads = [threading.Thread(target=load) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


def test_members_load_the_local_tokenizer_at_once(tiny_model):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=str(REPO), model=str(tiny_model))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
