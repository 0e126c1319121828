"""Completion scripts: up to date with the app, and completing in real bash, zsh and fish."""

import os
import shutil
import subprocess

import pytest
import typer

from kvctl.cli.app import app
from kvctl.cli.completion import render as render_over
from kvctl.core.completion.scripts import SCRIPT_NAMES
from tests.helpers import REPO, VENV_BIN, run_kvctl

SCRIPTS = REPO / "completions"


def render(shell: str) -> str:
    return render_over(shell, typer.main.get_command(app))


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_checked_in_scripts_are_up_to_date(shell):
    assert (SCRIPTS / SCRIPT_NAMES[shell]).read_text() == render(shell), (
        f"completions/{SCRIPT_NAMES[shell]} is stale: run 'make completions'")


# every command a user sees, in the order kvctl --help lists them
TOP_COMMANDS = ["config", "serve", "prewarm", "lookup", "keys", "ls", "pin", "unpin", "pins", "snapshot", "evict",
                "health", "stats", "top", "freeze", "hot-cache", "backends", "conf", "chunk-stats", "quota",
                "reconfigure", "checksums", "plugins", "doctor", "version", "model", "completion"]

def bash_complete(*words, path=None, env=None, cwd=None):
    line = " ".join(f"'{word}'" for word in words)
    script = (f'source {SCRIPTS / "kvctl.bash"}; COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); '
              '_kvctl_complete; printf "%s\\n" "${COMPREPLY[@]}"')
    done = subprocess.run([shutil.which("bash"), "--norc", "-c", script], capture_output=True, text=True,
                          env={"PATH": path or "/nonexistent", "HOME": os.environ["HOME"], **(env or {})}, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize(("words", "expected"), [
    (["kvctl", "con"], ["config", "conf"]),
    (["kvctl", ""], TOP_COMMANDS),
    (["kvctl", "config", ""], ["init", "validate", "show"]),
    (["kvctl", "config", "init", "--mo"], ["--mode", "--model"]),
    (["kvctl", "config", "init", "--mode", ""], ["inprocess", "mp"]),
    (["kvctl", "config", "init", "--hash-algorithm", "sha"], ["sha256", "sha256_cbor"]),
    (["kvctl", "config", "init", "--tier", "cpu:1", "--format", "j"], ["json"]),
    (["kvctl", "--format", "json", "config", "va"], ["validate"]),
    (["kvctl", "completion", "show", ""], ["bash", "zsh", "fish"]),
    (["kvctl", "config", "validate", "--de"], ["--debug"]),
    (["kvctl", "pin", ""], ["apply"]),  # a group that is also a command: its subcommands, and its options
    (["kvctl", "pin", "--tt"], ["--ttl"]),
    (["kvctl", "pin", "--ttl", "10m", "--tokens-file", "t.json", "--ti"], ["--tier", "--timeout"]),
    (["kvctl", "pin", "apply", "--dr"], ["--dry-run"]),
])
def test_bash_completes_without_starting_python(words, expected):
    assert bash_complete(*words) == expected  # PATH has no python and no kvctl


def test_bash_completes_paths(tmp_path):
    (tmp_path / "conf-dir").mkdir()
    (tmp_path / "conf.yaml").write_text("")
    assert (sorted(bash_complete("kvctl", "config", "validate", f"{tmp_path}/conf"))
            == [f"{tmp_path}/conf-dir", f"{tmp_path}/conf.yaml"])
    assert bash_complete("kvctl", "config", "init", "--out", f"{tmp_path}/conf") == [f"{tmp_path}/conf-dir"]


def model_cache(tmp_path):
    models = tmp_path / "cache" / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text("{}")
    (models / "broken").mkdir()
    return tmp_path / "cache"


def test_dynamic_values_call_back_into_kvctl(tmp_path):
    cache = model_cache(tmp_path)
    env = {"KVCTL_CACHE_DIR": str(cache)}
    completed = bash_complete("kvctl", "config", "init", "--model", "", path=f"{VENV_BIN}:/usr/bin:/bin", env=env,
                              cwd=tmp_path)
    assert completed == [str(cache / "models" / "tiny"), "cache/"]
    assert run_kvctl("complete-values", "models", str(cache / "models" / "t"), env=env).stdout.splitlines() == [
        str(cache / "models" / "tiny")]


def test_instance_names_come_from_the_inventory_and_running_serves(tmp_path):
    cache = tmp_path / "cache"
    (cache / "serve" / "blue").mkdir(parents=True)
    (cache / "serve" / "blue" / "state.json").write_text("{}")
    (tmp_path / "kvctl.yaml").write_text("instances:\n  node-a: {internal_api: http://127.0.0.1:7001}\n")
    completed = bash_complete("kvctl", "health", "--instance", "", path=f"{VENV_BIN}:/usr/bin:/bin",
                              env={"KVCTL_CACHE_DIR": str(cache)}, cwd=tmp_path)
    assert completed == ["all", "node-a", "blue"]


def fish_complete(line):
    done = subprocess.run(["fish", "--no-config", "-c", f"source {SCRIPTS / 'kvctl.fish'}; complete -C {line!r}"],
                          capture_output=True, text=True,
                          env={"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": os.environ["HOME"]})
    assert done.returncode == 0, done.stderr
    return [entry.split("\t")[0] for entry in done.stdout.splitlines()]


@pytest.mark.parametrize(("line", "expected"), [
    ("kvctl con", ["conf", "config"]),
    ("kvctl config ", ["init", "show", "validate"]),
    ("kvctl config init --mode ", ["inprocess", "mp"]),
    ("kvctl --format json config init --tier cpu:1 --hash-algorithm x", ["xxhash", "xxhash_cbor"]),
    ("kvctl completion show ", ["bash", "fish", "zsh"]),
    ("kvctl pin ", ["apply"]),
])
def test_fish_completes(line, expected):
    assert shutil.which("fish"), "fish is missing: run scripts/setup"
    assert sorted(fish_complete(line)) == sorted(expected)


ZSH_HARNESS = r"""
_describe() { local -a arr; arr=("${(@P)${@[-1]}}"); print -r -- "${(j: :)${arr[@]%%:*}}"; }
compadd() { shift $(( ${@[(i)--]} )); print -r -- "$*"; }
_files() { print -r -- "<files $*>"; }
compdef() { :; }
source SCRIPT
words=(WORDS); CURRENT=${#words}; PREFIX=${words[-1]}
_kvctl
"""


@pytest.mark.parametrize(("words", "expected"), [
    (["kvctl", "co"], " ".join(TOP_COMMANDS)),
    (["kvctl", "config", "init", "--mode", ""], "inprocess mp"),
    (["kvctl", "config", "init", "--out", ""], "<files -/>"),
    (["kvctl", "config", "validate", ""], "<files >"),
    (["kvctl", "completion", "install", ""], "bash zsh fish"),
])
def test_zsh_script_logic(words, expected):
    assert shutil.which("zsh"), "zsh is missing: run scripts/setup"
    script = ZSH_HARNESS.replace("SCRIPT", str(SCRIPTS / "_kvctl")).replace("WORDS", " ".join(f"'{w}'" for w in words))
    done = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_show_and_install_completion(tmp_path):
    env = {"HOME": str(tmp_path), "SHELL": "/usr/bin/zsh"}
    shown = run_kvctl("--show-completion", env=env)
    assert shown.code == 0 and shown.stdout == render("zsh")
    for shell, target in [("bash", ".bash_completions/kvctl.sh"), ("zsh", ".zfunc/_kvctl"),
                          ("fish", ".config/fish/completions/kvctl.fish")]:
        for _ in range(2):  # installing twice changes nothing more
            assert run_kvctl("--install-completion", env={**env, "SHELL": f"/bin/{shell}"}).code == 0
        assert (tmp_path / target).read_text() == render(shell)
    assert (tmp_path / ".bashrc").read_text() == "source ~/.bash_completions/kvctl.sh\n"
    assert (tmp_path / ".zshrc").read_text().count("fpath+=~/.zfunc") == 1


def test_unknown_shell_is_a_usage_error(tmp_path):
    result = run_kvctl("--show-completion", env={"SHELL": "/bin/tcsh"})
    assert result.code == 2 and result.stderr.splitlines()[1].startswith("hint: name it")
