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

from tests.cli import JOB, forked_python, run_cli, run_module, set_by_imports, zygote_pid
from tests.forked_python import FORK_SERVER_CODE, FRESH_RANK_ENV, parse_command

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
elif command == "hang":  # a process of its own and a rank launched from sys.executable, then wait
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    rank = subprocess.Popen([sys.executable, "-m", "cli_harness_probe", "sleep"])
    time.sleep(300)
elif command == "parent":
    print(os.getppid(), flush=True)
elif command == "sleep":  # a launched rank that waits
    print(os.getpid(), flush=True)
    time.sleep(300)
elif command == "rank":  # what a launched rank sees: torch's threads, Lightning's rank where asked (its import is long)
    import torch
    import __main__
    if sys.argv[2:] == ["lightning"]:
        from lightning.fabric.utilities.rank_zero import rank_zero_only
    else:
        rank_zero_only = None
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "name": __name__, "file": __main__.__file__,
        "spec": getattr(__main__.__spec__, "name", None), "cwd": os.getcwd(), "path": sys.path,
        "environ": {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_OPTIM_TEST_ZYGOTE")},
        "stdin": sys.stdin.read(), "threads": torch.get_num_threads(), "rank_zero_only": getattr(rank_zero_only, "rank", None),
    }), flush=True)
    print("its stderr", file=sys.stderr)
    raise SystemExit(int(os.environ["RANK"]) + 4)
elif command == "launch":  # as Lightning's launcher (-m) and torchrun (-u script) start ranks
    for rank, command in enumerate([["-m", "cli_harness_probe", "rank", "lightning"],
                                    ["-u", os.path.abspath(__file__), "rank"]], start=1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, input="in")
        report, *rest = done.stdout.splitlines()
        print(json.dumps([done.returncode, json.loads(report), rest, done.stderr]), flush=True)
    for signum in (15, 9):  # a rank killed by its launcher (SIGTERM) and by a signal of its own
        rank = subprocess.Popen([sys.executable, "-m", "cli_harness_probe", "sleep"], stdout=subprocess.PIPE)
        pid = int(rank.stdout.readline())
        (rank.terminate() if signum == 15 else os.kill(pid, 9))
        print(json.dumps([rank.wait(), pid]), flush=True)
'''


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    """A directory holding the probe module: importable only through ``python -m``'s sys.path[0], the cwd."""
    (tmp_path / f"{PROBE}.py").write_text(PROBE_SOURCE)
    return tmp_path


def fresh(module: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
          timeout: float = 240) -> subprocess.CompletedProcess:
    """The same command in a fresh interpreter (stdin /dev/null, as the forked run has); the environment is
    ``os.environ`` unless given, as ``run_module``'s (the C library's may hold more: readline's LINES)."""
    env = dict(os.environ) if env is None else env
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
    forked = run_module(PROBE, args, cwd=probe_dir, env=env, fork_launched=False)  # sys.executable: the real one
    expected = fresh(PROBE, args, probe_dir, env)
    assert expected.returncode == 0, expected.stderr
    seen, fresh_seen = (json.loads(run.stdout.splitlines()[0]) for run in (forked, expected))
    # the fresh interpreter has only start-up's filters; the forked run has the zygote's imports' around them
    filters, fresh_filters = seen.pop("filters"), fresh_seen.pop("filters")
    n = len(fresh_filters)
    assert any(filters[i:i + n] == fresh_filters for i in range(len(filters) - n + 1))
    assert "ResourceWarning" in fresh_filters[0]
    assert _less_what_the_zygote_imported(seen, fresh_seen) == fresh_seen
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
    start the other ranks as ``<tests/forked_python.py's executable> -m <the module> <its args>``; the zygote
    itself stays single-threaded."""
    seen = json.loads(run_module(PROBE, ["zygote", "x=1"], cwd=probe_dir).stdout.splitlines()[0])
    assert seen == {"preloaded": True, "threads": 1, "distributed": False,
                    "rank_command": [forked_python(), "-m", PROBE, "zygote", "x=1"]}
    assert os.listdir(f"/proc/{zygote_pid()}/task") == [str(zygote_pid())]


@pytest.mark.slow
def test_a_launched_rank_sees_what_a_fresh_rank_sees(probe_dir: Path):
    """A run starts ranks from ``sys.executable`` as Lightning's launcher (``-m module``) and torchrun (``-u
    script``) do, with a rank's environment (RANK, LOCAL_RANK, OMP_NUM_THREADS=1): forked through
    tests/forked_python.py they see what fresh interpreters see - argv, __main__, sys.path, environ, stdin,
    Lightning's import-time ``rank_zero_only.rank``, torch's intra-op threads - and give the same output and exit
    status; a rank its launcher terminates (SIGTERM) or that is killed (SIGKILL) ends as a killed one does."""
    forked, expected = run_module(PROBE, ["launch"], cwd=probe_dir), fresh(PROBE, ["launch"], probe_dir)
    assert expected.returncode == 0, expected.stderr[-3000:]
    assert forked.returncode == 0, forked.stderr[-3000:]
    ranks, fresh_ranks = ([json.loads(line) for line in run.stdout.splitlines()[:4]] for run in (forked, expected))
    assert forked.stdout.splitlines()[4:] == expected.stdout.splitlines()[4:] == ["an atexit handler ran"]
    for rank, fresh_rank in zip(ranks[:2], fresh_ranks[:2]):
        assert [*rank[:1], _less_what_the_zygote_imported(rank[1], fresh_rank[1]), *rank[2:]] == fresh_rank
    assert [r[0] for r in ranks[:2]] == [5, 6] and ranks[0][1]["rank_zero_only"] == 1
    assert all(r[1]["threads"] == 1 for r in ranks[:2]) and ranks[0][1]["spec"] == PROBE
    assert [r[0] for r in ranks[2:]] == [r[0] for r in fresh_ranks[2:]] == [-15, -9]
    assert all(_ends(pid) for _, pid in ranks[2:])


def test_launched_ranks_fork_from_the_zygote(probe_dir: Path):
    """The ranks a forked run launches are the zygote's children (no new interpreter); a command line the
    stand-in does not handle (``-c``) and the rank ``FRESH_RANK_ENV`` names run the real interpreter."""
    script = ("import os, subprocess, sys; print(os.getppid(), flush=True);"
              "subprocess.run([sys.executable, '-m', 'cli_harness_probe', 'parent']);"
              "subprocess.run([sys.executable, '-c', 'import os, sys; print(os.getppid(), sys.executable)']);"
              "print(os.getpid(), flush=True);"
              f"fresh = {{**os.environ, 'RANK': '1', {FRESH_RANK_ENV!r}: '1'}};"
              "subprocess.run([sys.executable, '-m', 'cli_harness_probe', 'parent'], env=fresh);"
              "subprocess.run([sys.executable, '-m', 'cli_harness_probe', 'parent'], env={**fresh, 'RANK': '0'})")
    (probe_dir / "launcher.py").write_text(script)
    run = run_module("launcher", [], cwd=probe_dir)
    assert run.returncode == 0, run.stderr
    launcher, launched, _, real, itself, fresh, _, other, _ = run.stdout.splitlines()  # _: a probe's atexit line
    assert launcher == launched == other == str(zygote_pid())  # the launcher and the ranks it launched: forked
    parent, executable = real.split()
    assert parent != str(zygote_pid()) and executable == sys.executable  # -c: a real child of the launcher
    assert fresh == itself  # the rank FRESH_RANK_ENV names: a new interpreter, the launcher's own child


def test_the_stand_in_takes_only_the_command_lines_it_can_fork():
    """``[-u] [-B] -m module|script`` and multiprocessing's fork server (the two descriptors its code names are
    passed on); anything else (another ``-c``, interpreter options it does not apply) runs the real interpreter."""
    assert parse_command(["-u", "-m", "mod", "-x"]) == {"flags": ["-u"], "module": "mod", "args": ["-x"]}
    assert parse_command(["-B", "run.py", "a"]) == {"flags": ["-B"], "script": os.path.abspath("run.py"), "args": ["a"]}
    code = FORK_SERVER_CODE + "7, 9, ['tests.worker_pool'], **{'sys_path': ['/x']})"
    assert parse_command(["-B", "-c", code]) == {"flags": ["-B"], "code": code, "args": [], "inherit": [7, 9]}
    later = FORK_SERVER_CODE + "7, 9, ['x'], **{'sys_path': ['/x'], 'authkey_r': 11})"  # a shape it does not know
    for other in (["-c", "print(1)"], ["-c", later], ["-W", "error", "-m", "mod"], ["-X", "dev", "run.py"], ["-m"],
                  []):
        assert parse_command(other) is None, other


def test_a_timeout_kills_the_run_and_what_it_started(probe_dir: Path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_module(PROBE, ["hang"], cwd=probe_dir, timeout=5)
    assert 5 <= time.monotonic() - started < 60
    assert info.value.cmd == [sys.executable, "-m", PROBE, "hang"] and info.value.timeout == 5
    started = [int(pid) for pid in info.value.output.split()]  # bytes, as subprocess.run's TimeoutExpired carries
    assert len(started) == 2  # a process of its own, a rank launched through tests/forked_python.py
    for pid in started:
        assert _ends(pid), f"process {pid}, started by the timed-out run, still runs"
    assert run_module(PROBE, ["exit", "0"], cwd=probe_dir).returncode == 0  # the zygote serves on


def _less_what_the_zygote_imported(seen: dict, fresh_seen: dict) -> dict:
    """A forked run's report less the environment variables the zygote's imports set that the fresh run's
    imports did not set (a probe that imports no Lightning: no Lightning variables)."""
    imported = {k: v for k, v in seen["environ"].items() if k not in fresh_seen["environ"]}
    assert imported.items() <= set_by_imports().items()
    return {**seen, "environ": {k: v for k, v in seen["environ"].items() if k not in imported}}


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
# Each comparison pays fresh interpreters' imports (~9 s of CPU each): the job's two outcomes the switched tests read
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
    """The default job (1-bit Adam on 2 processes, Lightning's launcher starting rank 1) past its 1-bit switch:
    the suite's one run of the real ``python -m`` start-up, rank 1 a fresh interpreter too. stdout is rank 0's;
    stderr holds both ranks' lines, in an order the two processes race for (fresh or forked alike)."""
    args = ["trainer=smoke", "trainer.max_steps=8", "trainer.val_check_interval=8", "strategy.freeze_step=4",
            "data.max_bytes=100000", "model.n_layer=1", "model.d_model=64", "hydra.run.dir=run"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    (tmp_path / "forked").mkdir()
    (tmp_path / "fresh").mkdir()
    forked = run_cli(args, cwd=tmp_path / "forked", env=env)
    expected = fresh(JOB, args, tmp_path / "fresh", env, timeout=240)
    assert expected.returncode == 0, expected.stderr[-3000:]
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert "1-bit stage starts" in expected.stdout and "GLOBAL_RANK: 1" in expected.stderr
    assert sorted(forked.stderr.splitlines()) == sorted(expected.stderr.splitlines())
    assert _untimed(forked.stdout, tmp_path / "forked") == _untimed(expected.stdout, tmp_path / "fresh")


def _untimed(stdout: str, cwd: Path) -> str:
    """The run's summary without what differs between two identical runs: its directory and its speed."""
    stdout = stdout.replace(str(cwd), "<cwd>")
    return re.sub(r"(train tokens/s|wall time) .*", r"\1 <timing>", stdout)
