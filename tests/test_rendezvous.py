"""CPU: the launcher's environment (_rendezvous.launch_environment), rank 0's value over TCP
(share_from_rank0) and `python -m cupy_flash launch`, without GPUs: the NCCL id is one JSON value
among others here (distributed.NcclRing.from_environment passes it; the GPU runs: docs/distributed.md)."""

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from cupy_flash import _rendezvous
from cupy_flash._rendezvous import Place, launch_environment, rendezvous_address, share_from_rank0


@pytest.mark.parametrize("environ, place", [
    ({}, Place(0, 1, 0, "")),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, Place(3, 4, 1, "RANK")),
    ({"RANK": "2", "WORLD_SIZE": "4"}, Place(2, 4, 2, "RANK")),   # no local rank: the rank
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     Place(1, 2, 1, "OMPI_COMM_WORLD_RANK")),
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}, Place(5, 8, 1, "PMI_RANK")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"}, Place(7, 8, 3, "SLURM_PROCID")),
    # torchrun's variables win over the MPI ones beside them; a rank without a world size is not a launcher's
    ({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, Place(0, 2, 0, "RANK")),
    ({"RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, Place(1, 2, 1, "SLURM_PROCID")),
])
def test_launch_environment_reads_each_launcher(environ, place):
    assert launch_environment(environ) == place


@pytest.mark.parametrize("environ, named", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 with WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1"),
])
def test_launch_environment_names_a_bad_variable(environ, named):
    with pytest.raises(ValueError, match=named):
        launch_environment(environ)


def test_rendezvous_address_takes_master_port_plus_one_unless_told():
    assert rendezvous_address({}) == ("127.0.0.1", _rendezvous.DEFAULT_PORT)
    assert rendezvous_address({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}) == ("node0", 29501)
    assert rendezvous_address({"MASTER_PORT": "29500", "CUPY_FLASH_PORT": "4000"}) == ("127.0.0.1", 4000)
    with pytest.raises(ValueError, match="65536"):
        rendezvous_address({"MASTER_PORT": "65535"})


def _ranks(world, address, job="job", jobs=None, timeout=20.0, made=(1, 2, -3)):
    """share_from_rank0 on ``world`` threads (rank 0 made ``made``): each rank's value or exception."""
    results = {}

    def rank(r):
        try:
            results[r] = share_from_rank0(Place(r, world, r, "RANK"), lambda: list(made), address,
                                          (jobs or {}).get(r, job), timeout)
        except Exception as error:   # noqa: BLE001 - the test reads it
            results[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]   # rank 0 last
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def test_every_rank_gets_rank_0s_value():
    address = ("127.0.0.1", _rendezvous.free_port_pair() + 1)
    results = _ranks(5, address)
    assert results == {r: [1, 2, -3] for r in range(5)}
    assert share_from_rank0(Place(0, 1, 0, ""), lambda: "alone", address) == "alone"   # a ring of one: no socket


def test_a_rank_of_another_job_is_refused_and_the_job_still_meets():
    """Rank 0 up first, a process of another job connects and is refused while rank 0 waits, then
    the job's ranks meet. (The stray connects before ranks 1 and 2 start: had it come after rank 0
    had served them and closed, the connection would just be reset, with no refusal to read.)"""
    address = ("127.0.0.1", _rendezvous.free_port_pair() + 1)
    results = {}

    def rank(r):
        results[r] = share_from_rank0(Place(r, 3, r, "RANK"), lambda: [1, 2, -3], address, "job", 10.0)

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    with pytest.raises(ValueError, match="another job"):
        _rendezvous._fetch(1, address, "another job", 10.0)   # retries until rank 0 listens
    others = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for thread in others:
        thread.start()
    for thread in [first, *others]:
        thread.join(15)
    assert results == {r: [1, 2, -3] for r in range(3)}


def test_rank_0_times_out_naming_the_ranks_that_did_not_come():
    address = ("127.0.0.1", _rendezvous.free_port_pair() + 1)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\]"):
        share_from_rank0(Place(0, 3, 0, "RANK"), lambda: 0, address, "", timeout=0.3)
    with pytest.raises(TimeoutError, match="could not reach rank 0"):
        share_from_rank0(Place(1, 3, 1, "RANK"), lambda: 0, address, "", timeout=0.3)


def _script(tmp_path, text):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_launch_runs_each_rank_with_torchruns_environment_and_they_meet(tmp_path):
    """`python -m cupy_flash launch -n 3 job.py out`: three processes, each reading its place and
    rank 0's value through the environment alone, as NcclRing.from_environment does."""
    script = _script(tmp_path, """
        import json, os, sys
        from cupy_flash import _rendezvous
        place = _rendezvous.launch_environment()
        value = _rendezvous.share_from_rank0(place, lambda: [os.getpid()], _rendezvous.rendezvous_address(),
                                             _rendezvous.job_id(), timeout=60)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        with open(os.path.join(sys.argv[1], f"rank{place.rank}.json"), "w") as out:
            json.dump({"place": list(place), "value": value, "env": {n: os.environ[n] for n in names}}, out)
    """)
    done = subprocess.run([sys.executable, "-m", "cupy_flash", "launch", "-n", "3", script, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [tuple(r["place"]) for r in ranks] == [(r, 3, r, "RANK") for r in range(3)]
    assert len({json.dumps(r["value"]) for r in ranks}) == 1
    assert {r["env"]["MASTER_PORT"] for r in ranks} == {ranks[0]["env"]["MASTER_PORT"]}
    assert all(r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == "3" for r in ranks)


def test_launch_stops_the_others_when_one_rank_fails(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
    """)
    done = subprocess.run([sys.executable, "-m", "cupy_flash", "launch", "-n", "3", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3


def test_launch_without_a_command_says_so():
    done = subprocess.run([sys.executable, "-m", "cupy_flash", "launch", "-n", "2"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "missing" in done.stderr


def test_a_rank_whose_rank_0_closes_mid_handshake_says_so():
    """Rank 0 accepts and closes (it failed, or gave up): the rank names rank 0 and the connection,
    not a bare reset from the socket."""
    import socket
    import threading

    from cupy_flash import _rendezvous

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def close_at_once():
        connection, _ = server.accept()
        connection.close()

    thread = threading.Thread(target=close_at_once)
    thread.start()
    try:
        with pytest.raises(ConnectionError, match=f"rank 1: rank 0 at 127.0.0.1:{port} closed the connection"):
            _rendezvous._fetch(1, ("127.0.0.1", port), "job", timeout=5.0)
    finally:
        thread.join()
        server.close()
