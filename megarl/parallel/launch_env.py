"""Who am I in the job? Rank, world size, local rank and rendezvous address from the launcher.

megarl joins its process group with torch's ``env://`` rendezvous, which reads torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Other
launchers describe the same facts in their own variables; :func:`export_launch_env` translates
them into torchrun's, once, at process start, so every later reader (logging, the layout check,
rank-0 file writes, the rendezvous) sees one consistent view. Sources, first match wins:

1. ``env`` -- torchrun, or a wrapper that sets ``RANK`` and ``WORLD_SIZE`` itself: kept as is
   (only checked);
2. ``mpi`` -- ``mpirun`` of Open MPI (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK``). It comes before
   Slurm because an ``mpirun`` inside an allocation starts its daemons with one srun step per
   node: there the Slurm variables describe the daemons, not megarl's processes;
3. ``slurm`` -- a task of an ``srun`` step (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``; the master is the first host of ``SLURM_STEP_NODELIST``, the port derived
   from the job and step ids so that concurrent jobs on a node do not collide). The batch script
   itself also has ``SLURM_PROCID``/``SLURM_NTASKS`` but no step variables: it is not a task;
4. ``mpi`` -- MPICH / Intel MPI's PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``), after
   Slurm because ``srun --mpi=pmi2`` sets both (then Slurm knows the master host, PMI does not);
5. ``single`` -- none of these: a world of one process.

MPI launchers do not name a master host. ``MASTER_ADDR`` (and ``MASTER_PORT``, default 29500,
torchrun's) from the environment are used when set (``mpirun -x MASTER_ADDR=...``); otherwise rank
0's host name is broadcast with mpi4py when it is installed (optional), or the error says what to
set. An explicitly set ``MASTER_ADDR``/``MASTER_PORT`` also wins over the Slurm-derived values.
"""
from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
"""torchrun's default master port, used for MPI launches without ``MASTER_PORT``."""
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 16000
"""Slurm launches rendezvous on ``SLURM_PORT_BASE + (job id * 16 + step id) % SLURM_PORT_SPAN``:
15000-30999, below Linux's ephemeral range (32768-60999), so no outgoing connection holds it."""


class LaunchEnvError(ValueError):
    """The launcher's environment is incomplete or contradicts itself (names the variables)."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as one launcher described it."""

    source: str
    """``env`` (torchrun or RANK/WORLD_SIZE set by hand), ``slurm``, ``mpi`` or ``single``."""
    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank among the processes on this node (selects the GPU)."""
    master_addr: str | None
    """Host of rank 0 (the rendezvous store); None for a world of one (any free local port)."""
    master_port: int | None
    """Port of the rendezvous store; None for a world of one."""


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``node[01-03,7],gpu5`` ->
    ``node01 node02 node03 node7 gpu5``. Zero padding is kept (``01-03``); several bracket groups
    in one name (``r[1-2]n[1-2]``) expand as a product, like ``scontrol show hostnames``."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(part, hostlist))
    if not hosts:
        raise LaunchEnvError(f"empty Slurm host list {hostlist!r}")
    return hosts


def _split_top_level(s: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p]


def _expand_one(name: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", name)
    if m is None:
        if "[" in name or "]" in name:
            raise LaunchEnvError(f"malformed Slurm host list {whole!r}: unbalanced brackets in {name!r}")
        return [name]
    prefix, ranges, rest = m.groups()
    out = []
    for r in ranges.split(","):
        lo, sep, hi = r.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchEnvError(f"malformed Slurm host list {whole!r}: range {r!r} in {name!r}")
        width = len(lo)  # "01-03": keep the padding of the lower bound, as Slurm does
        for i in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(prefix + str(i).zfill(width) + tail for tail in _expand_one(rest, whole))
    return out


def slurm_port(job_id: str, step_id: str | None) -> int:
    """The rendezvous port of a Slurm job step (see ``SLURM_PORT_BASE``)."""
    job, step = _int(job_id, "SLURM_JOB_ID"), _int(step_id or "0", "SLURM_STEP_ID")
    return SLURM_PORT_BASE + (job * 16 + step % 16) % SLURM_PORT_SPAN


def detect(env: MutableMapping[str, str] | None = None) -> LaunchEnv:
    """This process's :class:`LaunchEnv` from ``env`` (default ``os.environ``); raises
    :class:`LaunchEnvError` naming the variables when they are incomplete or inconsistent."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _from_mpi(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        slurm = _from_slurm(env)
        if "PMI_SIZE" in env and env["PMI_SIZE"] != str(slurm.world_size):
            # srun started launcher daemons (one per node, e.g. MPICH's hydra) that started the
            # MPI processes: PMI describes this process, Slurm the daemon.
            return _from_mpi(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
        return slurm
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return _from_mpi(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    return LaunchEnv("single", 0, 1, 0, None, None)


def export_launch_env(env: MutableMapping[str, str] | None = None) -> LaunchEnv:
    """:func:`detect`, then write the result into ``env`` (default ``os.environ``) as torchrun's
    variables, so that ``init_process_group("env://")`` and every ``RANK`` reader agree. Nothing
    is written for torchrun (already there) or a world of one (it rendezvouses on a free local
    port: several one-task steps of one job may share a node). Idempotent."""
    env = os.environ if env is None else env
    launch = detect(env)
    if launch.source in ("env", "single") or launch.world_size == 1:
        if launch.source == "single" and _int(env.get("SLURM_NTASKS", "1"), "SLURM_NTASKS") > 1:
            logger.warning("SLURM_NTASKS=%s but this process is not a task of an srun step (no "
                           "SLURM_STEP_NUM_TASKS): running as a world of one; launch it with srun",
                           env["SLURM_NTASKS"])
        return launch
    env.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
               MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
    logger.debug("launch from %s: rank %d of %d, master %s:%d", launch.source, launch.rank, launch.world_size,
                 launch.master_addr, launch.master_port)
    return launch


# ---- one function per launcher ----------------------------------------------------------------

def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchEnvError(f"{name}={value!r} is not an integer") from None


def _checked(source: str, rank: int, world: int, local: int, addr, port, names: tuple[str, str, str]) -> LaunchEnv:
    rank_name, world_name, local_name = names
    if world < 1:
        raise LaunchEnvError(f"{world_name}={world}: the world size must be >= 1")
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{rank_name}={rank} is outside the world of {world_name}={world} processes "
                             f"(valid: 0..{world - 1}); the launcher's variables contradict each other")
    if not 0 <= local < world:
        raise LaunchEnvError(f"{local_name}={local} is outside the world of {world_name}={world} processes "
                             f"(valid: 0..{world - 1})")
    if port is not None and not 0 < port < 65536:
        raise LaunchEnvError(f"master port {port} is invalid (valid: 1..65535)")
    return LaunchEnv(source, rank, world, local, addr, port)


def _from_torchrun(env) -> LaunchEnv:
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
    if missing:
        given = "RANK" if "RANK" in env else "WORLD_SIZE"
        raise LaunchEnvError(f"{' and '.join(missing)} not set while {given} is ({given}={env[given]!r}): set "
                             f"both (torchrun does; valid: 0 <= RANK < WORLD_SIZE), or neither (one process)")
    rank, world = _int(env["RANK"], "RANK"), _int(env["WORLD_SIZE"], "WORLD_SIZE")
    local = _int(env.get("LOCAL_RANK", "0"), "LOCAL_RANK")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise LaunchEnvError(f"RANK/WORLD_SIZE are set (world of {world}) but {' and '.join(missing)} not: "
                                 f"the env:// rendezvous needs the host and port of rank 0")
    port = _int(env["MASTER_PORT"], "MASTER_PORT") if env.get("MASTER_PORT") else None
    return _checked("env", rank, world, local, env.get("MASTER_ADDR"), port, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _from_slurm(env) -> LaunchEnv:
    rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    world = _int(env["SLURM_STEP_NUM_TASKS"], "SLURM_STEP_NUM_TASKS")
    local = _int(env.get("SLURM_LOCALID", "0"), "SLURM_LOCALID")
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchEnvError("srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: cannot tell the "
                                 "master host; set MASTER_ADDR")
        addr = expand_hostlist(nodelist)[0]
    if env.get("MASTER_PORT"):
        port = _int(env["MASTER_PORT"], "MASTER_PORT")
    elif env.get("SLURM_JOB_ID"):
        port = slurm_port(env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID"))
    else:
        raise LaunchEnvError("srun task without SLURM_JOB_ID: cannot derive the rendezvous port; set MASTER_PORT")
    return _checked("slurm", rank, world, local, addr, port, ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"))


def _from_mpi(env, rank_name: str, world_name: str, local_name: str) -> LaunchEnv:
    missing = [k for k in (rank_name, world_name) if k not in env]
    if missing:
        raise LaunchEnvError(f"MPI launch with {' and '.join(missing)} missing: the launcher sets "
                             f"{rank_name} and {world_name} together")
    rank, world = _int(env[rank_name], rank_name), _int(env[world_name], world_name)
    local = _int(env.get(local_name, "0"), local_name)
    port = _int(env["MASTER_PORT"], "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
    launch = _checked("mpi", rank, world, local, env.get("MASTER_ADDR"), port, (rank_name, world_name, local_name))
    if launch.master_addr or world == 1:
        return launch
    return LaunchEnv("mpi", rank, world, local, _mpi_master_addr(rank_name), port)


def _mpi_master_addr(rank_name: str) -> str:
    """Rank 0's host name, broadcast over MPI (mpi4py, optional)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchEnvError(f"MPI launch ({rank_name} set) without MASTER_ADDR, and mpi4py is not installed to "
                             f"look up rank 0's host: pass MASTER_ADDR (e.g. mpirun -x MASTER_ADDR=<first host>) "
                             f"or pip install mpi4py") from None
    return MPI.COMM_WORLD.bcast(socket.gethostname() if MPI.COMM_WORLD.Get_rank() == 0 else None, root=0)
