"""A real single-node Slurm for the tests: munged, slurmctld and slurmd on this host.

Everything of the cluster lives in one folder (``slurm.conf``, state, spool, logs, the job
completion file); clients find it through ``SLURM_CONF`` in :attr:`SingleNodeSlurm.env`, so a
system Slurm, if any, is left alone (the daemons listen on free ports). The settings are the ones
that work in a container without systemd or cgroups: ``proctrack/linuxproc``, ``task/none``, no
accounting database (job states come from ``scontrol show job`` and ``jobcomp/filetxt``).

Installing the packages is not done here: ``.ci/run`` installs ``slurm-wlm`` and ``munge`` (apt)
before the tests; on other machines :func:`start` raises :class:`SlurmUnavailable` naming what is
missing, and the tests skip with that reason.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "munged", "munge", "unmunge")
MUNGE_DIR = Path("/run/munge")
MUNGE_KEY = Path("/etc/munge/munge.key")
# job credential lifetime (s); also how long Slurm holds a requeued job before it may start again
CRED_EXPIRE_S = 10
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, not root, daemons would not start); says why."""


@dataclass
class Job:
    """One ``scontrol show job`` record."""

    id: int
    state: str
    exit_code: str
    restarts: int
    reason: str
    raw: dict = field(repr=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=False)
        return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True,
                                                      timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class SingleNodeSlurm:
    """A started cluster (see :func:`start`); :meth:`stop` ends the processes it started."""

    def __init__(self, root: Path, host: str, cpus: int):
        self.root, self.host, self.cpus = root, host, cpus
        self.conf = root / "slurm.conf"
        self.jobcomp = root / "jobcomp.txt"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged_pid: int | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=megarltest
# addresses given: the daemons need no name lookup (the job's rendezvous does: start() checks)
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
# A requeued job may start again only once its revoked credential has expired: Slurm holds it that long
# (BeginTime) and kills an earlier start with "Job credential revoked". 120 s by default; short here.
AuthInfo=cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
# no cgroups in a container: track job processes through /proc, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# without a database, a line per finished (or requeued) job run in this file
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# take CPUs from this file, not the hardware: 2 one-CPU tasks fit on a 1-core CI machine too
SlurmdParameters=config_overrides
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munge(self) -> None:
        if _munge_works():  # a munged is already running (a system one): use it
            return
        if not MUNGE_KEY.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True, capture_output=True)
            shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_DIR, "munge", "munge")
        # munged refuses to run as root; it daemonizes and writes its pid file
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True, timeout=30)
        pid_file = MUNGE_DIR / "munged.pid"
        deadline = time.monotonic() + 10
        while not _munge_works():
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged started but munge -n | unmunge still fails")
            time.sleep(0.1)
        self._munged_pid = int(pid_file.read_text()) if pid_file.exists() else None

    def _start_daemons(self) -> None:
        for daemon in ("slurmctld", "slurmd"):
            proc = subprocess.run([daemon, "-f", str(self.conf)], env=self.env, capture_output=True, text=True,
                                  timeout=60, check=False)
            if proc.returncode != 0:
                raise SlurmUnavailable(f"{daemon} did not start ({proc.returncode}): {proc.stderr[-2000:]}"
                                       f"{self.logs()}")
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-n", self.host, "-o", "%t"], env=self.env, capture_output=True,
                                 text=True, timeout=30, check=False).stdout.strip()
            if out == "idle":
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"node {self.host} not idle after 30 s (sinfo: {out!r}){self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                parts.append(f"\n--- {name} (tail)\n" + "\n".join(p.read_text().splitlines()[-20:]))
        return "".join(parts)

    def stop(self) -> None:
        """SIGTERM the daemons this object started (pids from their pid files), then munged if
        it was started here."""
        pids = []
        for name in ("slurmd.pid", "slurmctld.pid"):
            p = self.root / name
            if p.exists():
                pids.append(int(p.read_text().strip()))
        if self._munged_pid:
            pids.append(self._munged_pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)

    # ---- jobs ---------------------------------------------------------------------------------
    def run(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60,
                              check=False, **kw)

    def sbatch(self, script: Path, *args: str, env: dict | None = None, cwd: Path | None = None,
               options: tuple[str, ...] = ()) -> int:
        proc = self.run("sbatch", "--parsable", *options, str(script), *args, env=env or self.env, cwd=cwd)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> Job:
        proc = self.run("scontrol", "-o", "show", "job", str(job_id))
        assert proc.returncode == 0, f"scontrol show job {job_id}: {proc.stderr}"
        raw = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
        return Job(job_id, raw["JobState"], raw["ExitCode"], int(raw["Restarts"]), raw.get("Reason", ""), raw)

    def wait(self, job_id: int, until=None, timeout: float = 180.0, poll: float = 0.2) -> Job:
        """Poll the job until ``until(job)`` (default: it finished) or fail after ``timeout`` s."""
        until = until or (lambda j: j.state in FINISHED)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job.state} ({job.reason}) after {timeout} s{self.logs()}")
            time.sleep(poll)

    def completions(self, job_id: int) -> list[dict]:
        """The job's lines in the job completion file (one per run of it, requeues included)."""
        if not self.jobcomp.exists():
            return []
        lines = [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv) for ln in self.jobcomp.read_text().splitlines()]
        return [ln for ln in lines if ln.get("JobId") == str(job_id)]


def start(root: Path) -> SingleNodeSlurm:
    """Start munged (unless one runs), slurmctld and slurmd with a private config under ``root``
    and wait until the node is idle. Raises :class:`SlurmUnavailable` saying what is missing."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root to start jobs; run the tests as root (CI does)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        raise SlurmUnavailable("no 'munge' user (the munge package creates it)") from None
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        raise SlurmUnavailable(f"host name {host!r} does not resolve: slurmd and the job's rendezvous need it "
                               f"(add it to /etc/hosts)") from None
    cluster = SingleNodeSlurm(root, host, cpus=max(2, os.cpu_count() or 1))
    cluster._write_conf()
    try:
        cluster._start_munge()
        cluster._start_daemons()
    except BaseException:
        cluster.stop()
        raise
    return cluster
