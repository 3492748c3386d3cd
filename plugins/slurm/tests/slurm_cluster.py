"""A real Slurm cluster on this machine for the tests: munged, slurmctld and two slurmd
(``n1``, ``n2``: Slurm's multiple-slurmd mode, one port each), as root, every file under one
temporary directory, on ports chosen when it starts. :meth:`SlurmCluster.stop` leaves no
daemon, job, step process or file behind.

Every Slurm command needs ``SLURM_CONF`` (:attr:`SlurmCluster.env`). Both "nodes" share this
machine's host name, address and filesystem. A stopped daemon may linger as a zombie for a
few seconds here, so liveness is read from ``/proc/PID/stat``, never ``kill -0``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["NODES", "SlurmCluster", "alive", "cannot_run", "wait_for"]

NODES = ("n1", "n2")
#: The Debian packages, and the commands each brings.
PACKAGES = "slurmctld slurmd slurm-client munge"
COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch", "squeue", "scancel")
#: Each fake node's CPUs (more than this machine has: SlurmdParameters=config_overrides).
CPUS = 8


def cannot_run() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if not sys.platform.startswith("linux"):
        return "the Slurm tests need Linux"
    if os.geteuid() != 0:
        return (
            "the Slurm tests start munged, slurmctld and two slurmd as root (several slurmd on "
            "one machine need it): run them as root, as CI does"
        )
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): apt-get install "
            f"{PACKAGES} (scripts/test.sh does it when run as root)"
        )
    return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, or a pid gone, is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def wait_for(what: str, ready: Callable[[], bool], timeout: float) -> None:
    """Poll ``ready`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SlurmCluster:
    """The daemons and their files; :meth:`start`, then :meth:`stop` (idempotent)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="executor-slurm-"))
        self.conf = self.root / "slurm.conf"
        #: The environment every Slurm command of these tests runs with.
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    # --- up -----------------------------------------------------------------------------

    def start(self) -> None:
        root = self.root
        root.chmod(0o755)  # munged wants its socket's folder searchable
        for name in ("state", "log", "run", *(f"spool-{node}" for node in NODES)):
            (root / name).mkdir()
        munge = root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = root / "run" / "munge.socket"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--key-file={key}",
                f"--socket={self.socket}",
                f"--pid-file={root / 'run' / 'munged.pid'}",
                f"--seed-file={munge / 'seed'}",
                f"--log-file={root / 'log' / 'munged.log'}",
            ],
        )
        wait_for("munged's socket", self.socket.exists, 10.0)
        ctld, *node_ports = _free_ports(1 + len(NODES))
        self.conf.write_text(self._config(ctld, node_ports))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for node in NODES:
            self.start_slurmd(node)
        self.wait_idle(30.0)

    def _config(self, ctld_port: int, node_ports: list[int]) -> str:
        root = self.root
        lines = [
            f"ClusterName=executor{os.getpid()}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root}/spool-%n",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # Forget ended jobs soon (sbatch --wait polls less), a lost node within seconds.
            "MinJobAge=2",
            "SlurmdTimeout=3",
            "MessageTimeout=3",
            "KillWait=2",
            "InactiveLimit=0",
        ]
        for node, port in zip(NODES, node_ports, strict=True):
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={CPUS} State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES State=UP")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        with log:
            self.daemons[name] = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_slurmd(self, node: str) -> None:
        """Start node ``node``'s slurmd (again, after :meth:`kill_slurmd`)."""
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL node ``node``'s slurmd: to Slurm the node is lost (its steps run on)."""
        process = self.daemons.pop(f"slurmd-{node}")
        process.kill()
        process.wait(10)

    # --- looking ---------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> str:
        """A Slurm command's stdout."""
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle (no job on it, none completing)."""

        def idle() -> bool:
            return all(self.node_states().get(node) == "idle" for node in NODES)

        wait_for("both Slurm nodes idle", idle, timeout)

    def jobs(self) -> list[str]:
        """The jobs Slurm knows, as ``squeue`` lists them (``ID STATE NAME``)."""
        out = self.run("squeue", "--noheader", "--format=%i %T %j", check=False)
        return [line.strip() for line in out.splitlines() if line.strip()]

    def processes(self) -> dict[int, str]:
        """Every running process of this cluster's jobs (srun, salloc, slurmstepd, agents,
        workers: what has this cluster's ``SLURM_CONF``), but the daemons, their helpers
        (slurmctld's slurmscriptd) and this one."""
        mark = f"SLURM_CONF={self.conf}".encode()
        daemons = {process.pid for process in self.daemons.values()} | {os.getpid()}
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons:
                continue
            try:
                environ = (entry / "environ").read_bytes()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if _parent(int(entry.name)) in daemons:
                continue
            if mark in environ.split(b"\0") and alive(int(entry.name)):
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
        return found

    def assert_clean(self, timeout: float = 10.0) -> None:
        """No job and no process of this cluster's left, within ``timeout`` seconds."""

        def clean() -> bool:
            return not self.processes() and not [j for j in self.jobs() if "COMPLETING" not in j]

        try:
            wait_for("no job or process left", clean, timeout)
        except TimeoutError:
            raise AssertionError(
                f"left behind: jobs {self.jobs()}, processes {self.processes()}"
            ) from None

    # --- down -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop every daemon (by its pid), kill what is left, and remove
        the directory."""
        try:
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self.run("scancel", "--full", "--user=root", check=False)
                with contextlib.suppress(TimeoutError):
                    wait_for("no job left", lambda: not self.jobs(), 10.0)
            for name in sorted(self.daemons, key=lambda n: n == "munged"):  # munged last
                process = self.daemons[name]
                if process.poll() is None:
                    process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
            self.daemons.clear()
            for pid in self.processes():  # a step left by a lost node's slurmstepd
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
