"""A real one-node Slurm cluster on this machine, for the sbatch template tests.

``LocalSlurm`` writes a minimal slurm.conf for this host (one node with this machine's CPUs
and memory, one partition), starts its own munged, slurmctld and slurmd as root with every
socket, port, state and log file in a private temporary folder (so it neither needs nor
touches a system Slurm), waits until ``sinfo`` shows the node idle, and stops them again.
Commands reach it through ``SLURM_CONF`` (see ``env``).

Debian's packages (``apt-get install slurm-wlm munge``) give the binaries; ``make test``
installs them when it runs as root. Without them, or without root, ``unavailable()`` says
why and the tests skip.

Run ``python tests/slurm_cluster.py`` to start one by hand and keep it until Enter.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel", "squeue")
SBIN = ("/usr/sbin", "/usr/local/sbin")
NODE = socket.gethostname()  # the node's name must resolve: the templates rendezvous at the first host's name
PARTITION = "debug"


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why a local cluster cannot be started here, or None if it can."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return f"Slurm/munge binaries missing ({', '.join(missing)}); apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free a moment ago: each socket stays bound until all are chosen (one port taken twice
    would start two daemons on it)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _memory_mib() -> int:
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return int(total_kib / 1024 * 0.9)  # leave slurmd's own check some room


SLURM_CONF = """\
ClusterName=hybridlm-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class LocalSlurm:
    """One-node Slurm (munged + slurmctld + slurmd) living in ``root``; a context manager."""

    def __init__(self, root: str | None = None):
        self.root = root or tempfile.mkdtemp(prefix="hl-slurm-", dir="/tmp")  # short: the munge socket path is limited
        self.conf = os.path.join(self.root, "slurm.conf")
        self.cpus = os.cpu_count() or 1
        self.memory_mib = _memory_mib()
        self.partition = PARTITION
        self._procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict:
        """The environment that points Slurm's commands at this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster (``sbatch``, ``squeue``, ...)."""
        kw.setdefault("env", self.env)
        result = subprocess.run([_which(args[0]) or args[0], *args[1:]], capture_output=True, text=True, timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    # ---- life cycle
    def start(self, timeout: float = 60) -> "LocalSlurm":
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        os.chmod(self.root, 0o755)  # munged wants its socket's folder searchable by all
        with open(os.path.join(self.root, "plugstack.conf"), "w"):
            pass  # no SPANK plugins: the system's plugstack.conf.d must not leak in
        key = os.path.join(self.root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        try:
            self._spawn("munged", "--foreground", "--force", f"--socket={self.root}/munge.socket", f"--key-file={key}",
                        f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                        f"--seed-file={self.root}/munged.seed")
            self._wait_for(lambda: os.path.exists(f"{self.root}/munge.socket"), timeout, "munged's socket")
            for attempt in range(3):  # the daemons bind ports seen free a moment ago: another process may take one first
                ctld_port, slurmd_port = _free_ports(2)
                with open(self.conf, "w") as f:
                    f.write(SLURM_CONF.format(host=NODE, root=self.root, ctld_port=ctld_port, slurmd_port=slurmd_port,
                                              node=NODE, cpus=self.cpus, memory=self.memory_mib, partition=self.partition))
                self._spawn("slurmctld", "-D", "-i", "-f", self.conf)
                self._spawn("slurmd", "-D", "-f", self.conf)
                try:
                    self._wait_for(self._node_idle, timeout, f"node {NODE} to be idle in sinfo")
                    break
                except RuntimeError:  # a daemon exited at start-up
                    if attempt == 2 or "already in use" not in self.logs():
                        raise
                    self._stop_daemons(("slurmd", "slurmctld"))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, *args: str) -> None:
        log = open(os.path.join(self.root, f"{name}.stdout"), "w")
        self._procs.append(subprocess.Popen([_which(name), *args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))

    def _node_idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited {proc.returncode} at start-up; see {self.root}\n{self.logs()}")
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return result.returncode == 0 and f"{NODE} idle" in result.stdout

    @staticmethod
    def _wait_for(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.3)

    def stop(self, remove: bool = True) -> None:
        """Cancel what is left, stop the daemons (slurmd, slurmctld, munged: the reverse of start)
        and remove the cluster's folder."""
        if any(p.poll() is None for p in self._procs) and os.path.exists(self.conf):
            self.run("scancel", "--full", "--user=root", check=False, timeout=10)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def _stop_daemons(self, names: tuple[str, ...]) -> None:
        """Stop the named daemons that still run and forget them (a retry starts them afresh)."""
        for proc in [p for p in self._procs if os.path.basename(p.args[0]) in names]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            self._procs.remove(proc)

    def logs(self) -> str:
        """The tail of each daemon's log, for a failing test's message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmctld.stdout", "slurmd.stdout", "munged.stdout"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(parts)

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- jobs
    def sbatch(self, *args: str, cwd: str | None = None, env: dict | None = None) -> int:
        """Submit; returns the job id."""
        result = self.run("sbatch", "--parsable", *args, cwd=cwd, env={**self.env, **(env or {})})
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, ...)."""
        for attempt in range(5):  # scontrol can fail transiently while slurmctld handles a requeue
            result = self.run("scontrol", "show", "job", "-o", str(job_id), check=attempt == 4)
            if result.returncode == 0:
                break
            time.sleep(0.5)
        out = result.stdout
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def wait_until(self, job_id: int, predicate, timeout: float, what: str) -> dict:
        """Poll the job until ``predicate(fields)`` holds; a timeout says where the job was."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if predicate(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: timed out after {timeout:.0f} s waiting for {what}; "
                                   f"it is {fields.get('JobState')} (reason {fields.get('Reason')})\n{self.logs()}")
            time.sleep(0.5)


if __name__ == "__main__":
    reason = unavailable()
    if reason:
        raise SystemExit(reason)
    with LocalSlurm() as cluster:
        print(f"Slurm is up: export SLURM_CONF={cluster.conf}")
        print(cluster.run("sinfo").stdout)
        input("Enter stops it. ")
