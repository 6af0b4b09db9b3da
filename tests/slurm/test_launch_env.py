"""megarl/parallel/launch_env.py on fake environments: host lists, each launcher, precedence,
and clear errors on incomplete or contradictory variables. No Slurm needed."""
import pytest

from megarl.parallel.launch_env import (
    DEFAULT_PORT,
    LaunchEnvError,
    detect,
    expand_hostlist,
    export_launch_env,
    slurm_port,
)

SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "5", "SLURM_NTASKS": "16",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,7]", ["node01", "node02", "node03", "node04", "node7"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("dgx-h100-[10-11].ib", ["dgx-h100-10.ib", "dgx-h100-11.ib"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node[a-b]", "node]1[", "", "n[1-2,x]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(LaunchEnvError, match="host list"):
        expand_hostlist(bad)


def test_srun_task():
    got = detect(dict(SRUN))
    assert (got.source, got.rank, got.world_size, got.local_rank) == ("slurm", 5, 16, 5)
    assert got.master_addr == "gpu07" and got.master_port == slurm_port("4242", "0")


def test_slurm_port_differs_between_jobs_and_steps_and_stays_below_ephemeral_range():
    ports = {slurm_port(str(job), str(step)) for job in range(1000, 1100) for step in range(4)}
    assert len(ports) == 400
    assert all(15000 <= p < 31000 for p in ports)


def test_batch_script_is_not_a_task():
    """The batch step has SLURM_PROCID=0 and SLURM_NTASKS but no step variables: a world of one."""
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert detect(env).source == "single"


def test_explicit_master_wins_over_slurm_derived():
    got = detect({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (got.master_addr, got.master_port) == ("10.0.0.1", 1234)


def test_torchrun_has_priority_over_slurm():
    """srun starting one torchrun per node: torchrun's worker variables describe the worker."""
    env = {**SRUN, "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank) == ("env", 9, 16, 1)


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "MASTER_ADDR": "head"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port) == \
        ("mpi", 3, 8, 3, "head", DEFAULT_PORT)


def test_mpirun_inside_an_allocation_is_mpi():
    """mpirun's daemons run as one srun task per node: Slurm's variables describe them."""
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
           "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "MASTER_ADDR": "gpu07"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size) == ("mpi", 5, 16)


def test_srun_with_pmi2_is_slurm_and_hydra_proxies_are_pmi():
    env = {**SRUN, "PMI_RANK": "5", "PMI_SIZE": "16"}  # srun --mpi=pmi2: both agree; Slurm knows the host
    assert detect(env).source == "slurm" and detect(env).master_addr == "gpu07"
    env = {**SRUN, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "PMI_RANK": "9", "PMI_SIZE": "16",
           "MPI_LOCALRANKID": "1", "MASTER_ADDR": "gpu07"}  # MPICH hydra proxies started by srun
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank) == ("mpi", 9, 16, 1)


def test_mpi_without_master_addr_names_the_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpi4py(name, *a, **k):
        if name == "mpi4py":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpi4py)
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR.*mpi4py"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_single_process():
    got = detect({})
    assert (got.source, got.rank, got.world_size, got.master_addr) == ("single", 0, 1, None)


@pytest.mark.parametrize("env, match", [
    ({**SRUN, "SLURM_PROCID": "16"}, r"SLURM_PROCID=16 is outside the world of SLURM_STEP_NUM_TASKS=16"),
    ({**SRUN, "SLURM_LOCALID": "-1"}, r"SLURM_LOCALID=-1"),
    ({**SRUN, "SLURM_STEP_NUM_TASKS": "0"}, r"SLURM_STEP_NUM_TASKS=0: the world size must be >= 1"),
    ({**SRUN, "SLURM_PROCID": "x"}, r"SLURM_PROCID='x' is not an integer"),
    ({**SRUN, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, r"master host.*MASTER_ADDR"),
    ({**SRUN, "SLURM_JOB_ID": ""}, r"SLURM_JOB_ID.*MASTER_PORT"),
    ({**SRUN, "MASTER_PORT": "70000"}, r"port 70000"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"RANK=2 is outside .*WORLD_SIZE=2"),
    ({"RANK": "0"}, r"WORLD_SIZE not set while RANK is"),
    ({"WORLD_SIZE": "2"}, r"RANK not set while WORLD_SIZE is"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"MASTER_ADDR and MASTER_PORT not"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, r"OMPI_COMM_WORLD_SIZE missing"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "h"},
     r"OMPI_COMM_WORLD_RANK=4 is outside"),
])
def test_inconsistent_environment_is_named(env, match):
    with pytest.raises(LaunchEnvError, match=match):
        detect(env)


def test_export_writes_torchrun_variables_once():
    env = dict(SRUN)
    got = export_launch_env(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "gpu07", "MASTER_PORT": str(got.master_port)}
    again = export_launch_env(env)  # now torchrun-style: kept, same facts
    assert (again.source, again.rank, again.world_size, again.master_port) == ("env", 5, 16, got.master_port)


def test_export_leaves_torchrun_and_one_task_steps_alone():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    export_launch_env(env)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    one = {**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}
    export_launch_env(one)
    assert "RANK" not in one  # a world of one rendezvouses on a free local port


def test_batch_step_of_a_multi_task_job_warns(caplog):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}
    with caplog.at_level("WARNING"):
        assert export_launch_env(env).source == "single"
    assert "launch it with srun" in caplog.text
