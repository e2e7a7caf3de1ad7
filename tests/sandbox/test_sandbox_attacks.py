"""Attacks on the `bwrap` sandbox, one per row: (class, attempt, program). Each program prints ESCAPED only if
its attack worked; the host checks what the program cannot report itself (files it wrote, signals it sent,
processes it left). Run as root by pytest (CI), and as a table, by any user:

    python tests/sandbox/test_sandbox_attacks.py        # prints class | attempt | result, exits 1 on any escape
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from twinplane.sandbox import Limits, SandboxUnavailable, get_sandbox

PACKAGE = Path(__file__).resolve().parents[2] / "twinplane"
TOKEN = "twinplane-attack-secret-7f3a"  # planted in this process's environment and in a host file


def attacks(host_file: str, port: int, pid: int) -> list[tuple[str, str, str]]:
    pkg = str(PACKAGE)
    return [
        ("filesystem", "read a file in the host's /tmp",
         f"print('ESCAPED' if open({host_file!r}).read() else '')"),
        ("filesystem", "read /etc/passwd", "print('ESCAPED', open('/etc/passwd').read()[:20])"),
        ("filesystem", "list the user's home", "import os\nprint('ESCAPED', os.listdir(os.path.expanduser('~root')))"),
        ("filesystem", "read the installed package", f"print('ESCAPED', open({pkg + '/cli.py'!r}).read()[:9])"),
        ("filesystem", "write into the installed package",
         f"open({pkg + '/pwned.py'!r}, 'w').write('x')\nprint('ESCAPED')"),
        ("filesystem", "import torch / twinplane (hidden site-packages)", "import torch\nprint('ESCAPED')"),
        ("filesystem", "write into the interpreter's stdlib",
         "import os\nopen(os.__file__, 'a').write('#')\nprint('ESCAPED')"),
        ("filesystem", "find other samples' work dirs under /tmp",
         "import glob\nhits = glob.glob('/tmp/*') + glob.glob('/tmp/twinplane*')\nprint('ESCAPED' if hits else '')"),
        ("filesystem", "write past the file-size limit",
         "open('big', 'wb').write(b'x' * (64 << 20))\nprint('ESCAPED')"),
        ("proc", "read the trainer's environment via /proc",
         f"import glob\nfor p in glob.glob('/proc/*/environ'):\n"
         f"    try:\n        if {TOKEN!r} in open(p, errors='ignore').read(): print('ESCAPED', p)\n"
         f"    except OSError: pass"),
        ("proc", "see the trainer's process", f"import os\nprint('ESCAPED' if os.path.exists('/proc/{pid}') "
         f"and 'pytest' in open('/proc/{pid}/cmdline').read() + 'x' else '')"),
        ("proc", "read the trainer's memory via /proc/<pid>/mem",
         f"f = open('/proc/{pid}/mem', 'rb')\nprint('ESCAPED')"),
        ("proc", "reach the host /proc through /proc/1/root",
         f"import os\nprint('ESCAPED' if os.path.exists('/proc/1/root/proc/{pid}/environ') and "
         f"{TOKEN!r} in open('/proc/1/root/proc/{pid}/environ', errors='ignore').read() else '')"),
        ("network", "socket.create_connection to a host server",
         f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('ESCAPED')"),
        ("network", "raw _socket (no Python-level patch to bypass)",
         f"import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n"
         "print('ESCAPED')"),
        ("network", "child interpreter connects",
         f"import subprocess, sys\nr = subprocess.run([sys.executable, '-c', \"import socket; "
         f"socket.create_connection(('127.0.0.1', {port}), timeout=1); print('ESCAPED')\"], capture_output=True, "
         "text=True)\nprint(r.stdout)"),
        ("network", "any interface but loopback", "import socket\nnames = [n for _, n in socket.if_nameindex()]\n"
         "print(('ESCAPED', names) if set(names) - {'lo'} else '')"),
        ("processes", "fork past the process limit",
         "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
         "            time.sleep(30)\n            os._exit(0)\n"
         "        n += 1\nexcept OSError:\n    pass\nprint('ESCAPED' if n >= 64 else '', n)"),
        ("processes", "threads past the process limit",
         "import threading, time\nn = 0\ntry:\n    for _ in range(200):\n"
         "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
         "except RuntimeError:\n    pass\nprint('ESCAPED' if n >= 64 else '', n)"),
        ("processes", "raise its own limits",
         "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\nprint('ESCAPED')"),
        ("processes", "allocate past the memory limit", "x = bytearray(2 << 30)\nprint('ESCAPED')"),
        ("lifetime", "setsid + double fork, outlive the call",
         f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
         f"        os.execv('/bin/sleep', ['sleep', '77.{pid}'])\n    os._exit(0)\nprint('spawned')"),
        ("signals", "SIGTERM the trainer", f"import os, signal\nos.kill({pid}, signal.SIGTERM)\nprint('ESCAPED')"),
        ("signals", "SIGKILL everything it can see", "import os, signal\nos.kill(-1, signal.SIGKILL)"),
        ("privilege", "become root in the namespace", "import os\nos.setuid(0)\nprint('ESCAPED')"),
        ("privilege", "mount the host disk", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "r = libc.mount(b'none', b'/w', b'tmpfs', 0, None)\nprint('ESCAPED' if r == 0 else '')"),
        ("privilege", "new user namespace to regain capabilities",
         "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.unshare(0x10000000 | 0x00020000)\n"
         "print('ESCAPED' if r == 0 and libc.mount(b'none', b'/usr', b'tmpfs', 0, None) == 0 else '')"),
        ("devices", "read host block devices", "import glob\nprint('ESCAPED' if glob.glob('/dev/sd*') + "
         "glob.glob('/dev/nvme*') + glob.glob('/dev/vd*') else '')"),
    ]


def leftover_pids(tag: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if tag in (p / "cmdline").read_bytes().decode(errors="ignore"):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def run_suite() -> list[tuple[str, str, str]]:
    """-> rows (class, attempt, result) with result 'blocked' or 'ESCAPED: why'."""
    sandbox = get_sandbox("bwrap")
    os.environ["TWINPLANE_ATTACK_TOKEN"] = TOKEN
    got_signal = []
    old = signal.signal(signal.SIGTERM, lambda *a: got_signal.append(1))
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".secret") as host_file, \
            socket.create_server(("127.0.0.1", 0)) as server:
        host_file.write(TOKEN)
        host_file.flush()
        server.settimeout(0.05)
        port, pid = server.getsockname()[1], os.getpid()
        limits = Limits(wall_s=8, cpu_s=4, memory_mb=512, file_mb=16, processes=32)
        for kind, attempt, code in attacks(host_file.name, port, pid):
            r = sandbox.run({"main.py": code}, [sandbox.python, "-I", "main.py"], limits=limits)
            why = []
            if b"ESCAPED" in r.stdout:
                why.append(r.stdout.decode(errors="replace").strip()[:80])
            try:
                server.accept()[0].close()
                why.append("a connection reached the host")
            except TimeoutError:
                pass
            if got_signal:
                why.append("the trainer got SIGTERM")
                got_signal.clear()
            if (PACKAGE / "pwned.py").exists():
                (PACKAGE / "pwned.py").unlink()
                why.append("wrote into the package")
            time.sleep(0.05)
            if leftover_pids(f"77.{pid}"):
                for p in leftover_pids(f"77.{pid}"):
                    os.kill(p, signal.SIGKILL)
                why.append("a process outlived the call")
            rows.append((kind, attempt, "ESCAPED: " + "; ".join(why) if why else f"blocked ({r.status})"))
    signal.signal(signal.SIGTERM, old)
    del os.environ["TWINPLANE_ATTACK_TOKEN"]
    return rows


def test_attack_suite_zero_escapes():
    try:
        get_sandbox("bwrap")
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    rows = run_suite()
    escaped = [r for r in rows if r[2].startswith("ESCAPED")]
    assert not escaped, escaped
    assert len(rows) >= 25


if __name__ == "__main__":
    table = run_suite()
    print(f"uid {os.getuid()}\n| class | attempt | result |\n|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    n = sum(r[2].startswith("ESCAPED") for r in table)
    print(f"{len(table)} attacks, {n} escapes")
    sys.exit(1 if n else 0)
