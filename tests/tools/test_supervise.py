"""The restart loop against small fake training programs that record each launch's argv in a state file."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinplane.tools import supervise as sv

# Exits with the code planned for this launch (the last entry repeats); "kill" dies by SIGKILL.
PLANNED = """
import json, os, signal, sys
state, plan = sys.argv[1], sys.argv[2].split(",")
launches = json.load(open(state)) if os.path.exists(state) else []
launches.append(sys.argv[3:])
json.dump(launches, open(state, "w"))
step = plan[min(len(launches), len(plan)) - 1]
if step == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(step))
"""

# Traps SIGTERM/SIGINT like `twinplane train`: the first writes the marker (the emergency checkpoint) and, unless
# told to linger, exits 75; the second exits at once with 1.
TRAPPING = """
import json, os, signal, sys, time
state, marker, linger = sys.argv[1], sys.argv[2], sys.argv[3] == "linger"
launches = json.load(open(state)) if os.path.exists(state) else []
launches.append(sys.argv[4:])
json.dump(launches, open(state, "w"))
def on_signal(signum, frame):
    if os.path.exists(marker):
        sys.exit(1)
    open(marker, "w").write(signal.Signals(signum).name)
    if not linger:
        sys.exit(75)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
open(state + ".tmp", "w").write(str(os.getpid()))
os.replace(state + ".tmp", state + ".ready")  # atomic: the test reads the pid once the file exists
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def planned(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(PLANNED)
    state = tmp_path / "launches.json"

    def make(plan: str, *extra: str) -> tuple[list[str], Path]:
        return [sys.executable, str(script), str(state), plan, *extra], state
    return make


def run(cmd, max_restarts, **kw):
    sleeps, logs = [], []
    code = sv.supervise(cmd, max_restarts, sleep=sleeps.append, log=logs.append, **kw)
    return code, sleeps, logs


def test_preempted_twice_then_finishes(planned):
    cmd, state = planned("75,75,0", "--run-dir", "r")
    code, sleeps, logs = run(cmd, 5)
    launches = json.loads(state.read_text())
    assert code == 0
    resumed = ["--run-dir", "r", "--resume", "auto"]
    assert launches == [["--run-dir", "r"], resumed, resumed]
    assert sleeps == [5.0, 10.0]
    assert logs[0] == "supervise: run 1/6 exited with 75 (preempted); restarting with --resume auto in 5.0s"


def test_crash_gives_up_after_max_restarts(planned):
    cmd, state = planned("1")
    code, sleeps, logs = run(cmd, 3)
    assert code == 1
    assert len(json.loads(state.read_text())) == 4
    assert len(sleeps) == 3
    assert logs[-1] == "supervise: run 4/4 exited with 1 (crashed); gave up after 3 restarts"


def test_configuration_error_is_not_retried(planned):
    cmd, state = planned("2")
    code, sleeps, logs = run(cmd, 3)
    assert (code, sleeps, len(json.loads(state.read_text()))) == (2, [], 1)
    assert logs == ["supervise: run 1/4 exited with 2 (configuration error); configuration error: not restarting"]


def test_signal_death_is_a_crash(planned):
    cmd, state = planned("kill,0")
    code, sleeps, logs = run(cmd, 3)
    assert (code, len(json.loads(state.read_text()))) == (0, 2)
    assert "was killed by SIGKILL (crashed)" in logs[0]
    cmd, state = planned("kill")
    state.unlink()
    assert run(cmd, 1)[0] == 128 + signal.SIGKILL  # shell convention for the code given up with


@pytest.mark.parametrize("healthy_after_s, expected", [(1e9, [1.0, 2.0, 4.0, 5.0, 5.0]), (0.0, [1.0] * 5)])
def test_backoff_doubles_caps_and_resets_after_a_healthy_run(planned, healthy_after_s, expected):
    cmd, _ = planned("1")
    code, sleeps, _ = run(cmd, 5, backoff_s=1.0, max_backoff_s=5.0, healthy_after_s=healthy_after_s)
    assert (code, sleeps) == (1, expected)


def test_resume_auto_rewrites_argv():
    assert sv.resume_auto(["t", "train"]) == ["t", "train", "--resume", "auto"]
    assert sv.resume_auto(["t", "--resume", "ckpt/step_10", "x=1"]) == ["t", "--resume", "auto", "x=1"]
    assert sv.resume_auto(["t", "--resume=ckpt/step_10"]) == ["t", "--resume=auto"]
    assert sv.resume_auto(["t", "--resume"]) == ["t", "--resume", "auto"]


def test_explicit_resume_is_kept_first_then_replaced(planned):
    cmd, state = planned("75,0", "--resume", "ckpt/step_10")
    assert run(cmd, 2)[0] == 0
    assert json.loads(state.read_text()) == [["--resume", "ckpt/step_10"], ["--resume", "auto"]]


def test_main_rejects_missing_command():
    with pytest.raises(SystemExit) as e:
        sv.main(["--max-restarts", "2"])
    assert e.value.code == 2


@contextlib.contextmanager
def sigint_for_children(handler):
    """Children started inside see SIGINT as `handler` leaves it: a handler becomes the default on exec (a shell's
    foreground job), SIG_IGN is inherited (a job started with `&` in a script)."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_supervisor(tmp_path, linger: bool, backoff: float = 0.0, ready: bool = True,
                     sigint=signal.default_int_handler):
    """The supervisor in its own process (`twinplane.tools.supervise` imports no torch: it starts in milliseconds)."""
    script = tmp_path / "trap.py"
    script.write_text(TRAPPING)
    state, marker = tmp_path / "launches.json", tmp_path / "checkpoint.marker"
    # As a module and without `site`: before any code of the supervisor runs, CPython swallows a SIGINT that
    # interrupts site's .pth files or a script's import-path check (see the module's docstring).
    cmd = [sys.executable, "-S", "-m", "twinplane.tools.supervise", "--max-restarts", "3", "--backoff", str(backoff),
           "--", sys.executable, str(script), str(state), str(marker), "linger" if linger else "exit"]
    env = dict(os.environ, PYTHONPATH=str(Path(sv.__file__).parents[2]))
    with sigint_for_children(sigint):
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    ready_file = Path(f"{state}.ready")
    deadline = time.monotonic() + 10
    while ready and not ready_file.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "child never became ready"
        time.sleep(0.02)
    return proc, state, marker


def running(tag: str) -> list[int]:
    """Live processes whose command line mentions `tag` (a test's own folder); zombies have none."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and tag.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_is_forwarded_and_not_restarted(tmp_path, sig):
    proc, state, marker = start_supervisor(tmp_path, linger=False)
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == 75
    assert marker.read_text() == "SIGTERM"  # the child got the stop once, as SIGTERM, and wrote its checkpoint
    assert len(json.loads(state.read_text())) == 1
    assert "not restarting" in proc.stderr.read()


def test_second_signal_is_forwarded_again(tmp_path):
    proc, state, marker = start_supervisor(tmp_path, linger=True)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "first signal not forwarded"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 1
    assert len(json.loads(state.read_text())) == 1


def test_signal_during_backoff_stops_without_waiting(tmp_path):
    proc, state, marker = start_supervisor(tmp_path, linger=False, backoff=60.0)
    os.kill(int(Path(f"{state}.ready").read_text()), signal.SIGTERM)  # preempt the child alone: it exits 75
    assert "restarting with --resume auto in 60.0s" in proc.stderr.readline()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 75
    assert time.monotonic() - started < 5
    assert len(json.loads(state.read_text())) == 1


def test_stop_signal_is_acted_on_when_inherited_as_ignored(tmp_path):
    """A script's `&` job starts with SIGINT ignored; `kill -INT` still stops it (checkpoint, exit 75)."""
    proc, state, marker = start_supervisor(tmp_path, linger=False, sigint=signal.SIG_IGN)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 75
    finally:
        for pid in running(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert marker.read_text() == "SIGTERM"


def test_signal_received_before_the_supervisor_starts_nothing(planned):
    cmd, state = planned("0")
    code, sleeps, logs = run(cmd, 3, received=(signal.SIGTERM,))
    assert (code, sleeps, state.exists()) == (128 + signal.SIGTERM, [], False)
    assert logs == ["supervise: received SIGTERM before starting; not starting"]


def _signal_state(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "gone"
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(("State", "Sig", "ShdPnd")))


# Seconds after the supervisor's process starts; None: once its child has its handlers. The first moments fall in
# the interpreter's start-up, then come argument parsing, the child's launch and the child's own start-up.
MOMENTS = [0.0, 0.002, 0.005, 0.01, 0.02, 0.03, 0.045, 0.06, 0.08, 0.1, 0.13, 0.17, 0.22, 0.3, 0.4, None]
CPYTHON_DROPPED = ("Exception ignored in", "Remainder of file ignored", "Failed checking if argv[0]")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_at_any_moment_ends_supervisor_and_child(tmp_path, sig):
    """Never lost: whenever it comes, the supervisor and its child both end, with the documented code: 75 once the
    child's handlers ran (it checkpointed), 143 if the child died of the forwarded SIGTERM while starting up,
    else 128+N: nothing had started (1 from CPython itself for a SIGINT while it initialises). No restart."""
    outcomes = []
    for i, moment in enumerate(MOMENTS):
        trial = tmp_path / f"at{i}"
        trial.mkdir()
        proc, state, marker = start_supervisor(trial, linger=False, ready=moment is None)
        time.sleep(moment or 0)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            err = "(still running after 10 s)"
        left = running(str(trial))
        status = {pid: _signal_state(pid) for pid in left}
        for pid in left:  # (a failure must not leave the job running)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            err += proc.communicate()[1]
            if sig == signal.SIGINT and "KeyboardInterrupt" in err and any(m in err for m in CPYTHON_DROPPED):
                continue  # dropped by CPython before any code of the supervisor ran (see its docstring)
        assert not left, (f"at {moment}s: the stop was lost (left running: {status}; files "
                          f"{sorted(p.name for p in trial.iterdir())})\n{err}")
        code = sv.exit_code(proc.returncode)
        checkpointed, forwarded = marker.exists(), "asking the child to stop (SIGTERM)" in err
        if checkpointed:
            expected = {75}
        elif forwarded:  # the child died of it while starting up
            expected = {128 + signal.SIGTERM}
        elif sig == signal.SIGINT and any(m in err for m in ("Fatal Python error: init_", "Could not import runpy")):
            expected = {128 + sig, 1}  # nothing had started: CPython itself, initialising, can end with 1
        else:
            expected = {128 + sig}  # nothing had started
        assert code in expected, f"at {moment}s: exit {code}\n{err}"
        assert not checkpointed or marker.read_text() == "SIGTERM"
        assert "restarting with" not in err, f"at {moment}s: restarted after a stop\n{err}"
        outcomes.append((checkpointed, forwarded))
    assert outcomes[0] == (False, False) and outcomes[-1][0]  # the sweep spans start-up to a running child
