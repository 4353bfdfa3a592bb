"""tests/cli.py is honest: a run forked from the zygote exits, prints and sees its world as a fresh
``python -m`` of the same command does (probes: a small module in the test's directory; the job itself:
a few cases of each kind), and a timeout kills the run with everything it started."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import JOB, run_cli, run_module, zygote_pid

PROBE = "cli_harness_probe"
PROBE_SOURCE = '''
import atexit, json, os, subprocess, sys, threading, time, warnings

atexit.register(print, "an atexit handler ran")
command = sys.argv[1]
if command == "report":  # what the run sees of its world
    import __main__
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "spec": __main__.__spec__.name,
        "cwd": os.getcwd(), "path": sys.path, "environ": dict(os.environ), "warnoptions": sys.warnoptions,
        "filters": [repr(f) for f in warnings.filters], "stdin": sys.stdin.read(),
    }), flush=True)
    os.write(1, b"written to fd 1 by the OS, not by sys.stdout\\n")
    subprocess.run([sys.executable, "-c", "import sys; print('a child process'); print('its stderr', file=sys.stderr)"])
    threading.Thread(target=lambda: (time.sleep(0.3), print("a non-daemon thread finished"))).start()
elif command == "exit":
    raise SystemExit(json.loads(sys.argv[2]))
elif command == "raise":
    try:
        {}["missing"]
    except KeyError as error:
        raise ValueError("while looking something up") from error
elif command == "interrupt":
    raise KeyboardInterrupt
elif command == "zygote":  # what the run inherited from the zygote
    import threading, torch.distributed
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
    print(json.dumps({"preloaded": "lightning" in sys.modules and "hydra" in sys.modules,
                      "threads": threading.active_count(), "distributed": torch.distributed.is_initialized(),
                      "rank_command": list(_basic_subprocess_cmd())}))
elif command == "hang":  # a process of its own, then wait
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    time.sleep(300)
'''


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    """A directory holding the probe module: importable only through ``python -m``'s sys.path[0], the cwd."""
    (tmp_path / f"{PROBE}.py").write_text(PROBE_SOURCE)
    return tmp_path


def fresh(module: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
          timeout: float = 240) -> subprocess.CompletedProcess:
    """The same command in a fresh interpreter (stdin /dev/null, as the forked run has)."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def assert_same(forked: subprocess.CompletedProcess, expected: subprocess.CompletedProcess) -> None:
    assert forked.args == expected.args
    assert (forked.returncode, forked.stdout, forked.stderr) == (expected.returncode, expected.stdout, expected.stderr)


# ------------------------------------------------------------------------------------------------ probes
def test_the_run_sees_what_a_fresh_interpreter_sees(probe_dir: Path):
    """argv, __main__, cwd, sys.path (with PYTHONPATH), environ, PYTHONWARNINGS's filters; output written
    by the OS, by a child process and by a thread, and the atexit handler's, all captured and in order."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["extra", "/nowhere"]), "CLI_PROBE": "yes",
           "PYTHONWARNINGS": "ignore::DeprecationWarning,error::ResourceWarning"}
    args = ["report", "--flag", "value with spaces"]
    forked, expected = run_module(PROBE, args, cwd=probe_dir, env=env), fresh(PROBE, args, probe_dir, env)
    assert expected.returncode == 0, expected.stderr
    seen, fresh_seen = (json.loads(run.stdout.splitlines()[0]) for run in (forked, expected))
    # the fresh interpreter has only start-up's filters; the forked run has the zygote's imports' above them
    filters, fresh_filters = seen.pop("filters"), fresh_seen.pop("filters")
    assert filters[-len(fresh_filters):] == fresh_filters and "ResourceWarning" in fresh_filters[0]
    assert seen == fresh_seen
    assert seen["path"][:3] == [str(probe_dir), str(probe_dir / "extra"), "/nowhere"]
    assert forked.args == expected.args and forked.returncode == expected.returncode == 0
    assert forked.stderr == expected.stderr == "its stderr\n"
    assert forked.stdout.splitlines()[1:] == expected.stdout.splitlines()[1:] == [
        "written to fd 1 by the OS, not by sys.stdout", "a child process", "a non-daemon thread finished",
        "an atexit handler ran"]


@pytest.mark.parametrize("args", [["exit", "null"], ["exit", "3"], ["exit", "263"], ["exit", "-1"],
                                  ["exit", '"a message"'], ["exit", "true"], ["raise"], ["interrupt"]],
                         ids=lambda args: " ".join(args))
def test_exit_statuses_and_tracebacks_match(probe_dir: Path, args: list[str]):
    """SystemExit's code as the interpreter maps it; an uncaught exception's traceback from the same frames
    (runpy's, not the harness's); an uncaught ^C ends the run by SIGINT."""
    assert_same(run_module(PROBE, args, cwd=probe_dir), fresh(PROBE, args, probe_dir))


def test_the_zygote_preloaded_and_stays_fork_safe(probe_dir: Path):
    """The run finds the job's libraries imported, one thread, no process group; Lightning's launcher would
    start the other ranks as ``python -m <the module> <its args>``; the zygote itself stays single-threaded."""
    seen = json.loads(run_module(PROBE, ["zygote", "x=1"], cwd=probe_dir).stdout.splitlines()[0])
    assert seen == {"preloaded": True, "threads": 1, "distributed": False,
                    "rank_command": [sys.executable, "-m", PROBE, "zygote", "x=1"]}
    assert os.listdir(f"/proc/{zygote_pid()}/task") == [str(zygote_pid())]


def test_a_timeout_kills_the_run_and_what_it_started(probe_dir: Path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_module(PROBE, ["hang"], cwd=probe_dir, timeout=5)
    assert 5 <= time.monotonic() - started < 60
    assert info.value.cmd == [sys.executable, "-m", PROBE, "hang"] and info.value.timeout == 5
    grandchild = int(info.value.output.split()[0])  # bytes, as subprocess.run's TimeoutExpired carries
    assert _ends(grandchild), f"process {grandchild}, started by the timed-out run, still runs"
    assert run_module(PROBE, ["exit", "0"], cwd=probe_dir).returncode == 0  # the zygote serves on


def _ends(pid: int, within_s: float = 10) -> bool:
    """Whether the process is gone (or a zombie: killed, its new parent has not reaped it yet) soon."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_a_missing_cwd_fails_as_subprocess_run_does(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        run_cli(["--help"], cwd=tmp_path / "missing")


# --------------------------------------------------------------------------------------------- the job
# Each comparison pays a fresh interpreter's imports (~7 s): the job's two outcomes the switched tests read
# (a config error here, a training run below); exit statuses and tracebacks in general are the probe's cases.
@pytest.mark.slow
def test_a_config_error_matches_a_fresh_interpreter(tmp_path: Path):
    args, env = ["hydra.run.dir=run", "trainer.gradient_clip_val=-1"], dict(os.environ)  # exit 2, one line
    (tmp_path / "forked").mkdir()
    (tmp_path / "fresh").mkdir()
    forked, expected = run_cli(args, cwd=tmp_path / "forked", env=env), fresh(JOB, args, tmp_path / "fresh", env)
    assert_same(forked, expected)


@pytest.mark.slow
def test_a_training_run_matches_but_for_its_timings(tmp_path: Path):
    args = ["trainer=smoke", "data.max_bytes=100000", "strategy=auto", "trainer.devices=1", "trainer.max_steps=3",
            "model.n_layer=1", "model.d_model=64", "hydra.run.dir=run"]
    (tmp_path / "forked").mkdir()
    (tmp_path / "fresh").mkdir()
    forked, expected = run_cli(args, cwd=tmp_path / "forked"), fresh(JOB, args, tmp_path / "fresh")
    assert expected.returncode == 0, expected.stderr[-3000:]
    assert forked.returncode == 0 and forked.stderr == expected.stderr
    assert _untimed(forked.stdout, tmp_path / "forked") == _untimed(expected.stdout, tmp_path / "fresh")


def _untimed(stdout: str, cwd: Path) -> str:
    """The run's summary without what differs between two identical runs: its directory and its speed."""
    stdout = stdout.replace(str(cwd), "<cwd>")
    return re.sub(r"(train tokens/s|wall time) .*", r"\1 <timing>", stdout)
