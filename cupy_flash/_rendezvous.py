"""Which rank this process is, and rank 0's NCCL id on every rank, from the launcher's environment.

Launchers name a process's place in the job through environment variables; ``launch_environment``
reads them in this order:
    torchrun, ``python -m cupy_flash launch``, and most hand-written scripts: RANK, WORLD_SIZE,
        LOCAL_RANK (MASTER_ADDR, MASTER_PORT: where rank 0 can be reached);
    Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
    MPICH's and Intel MPI's: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID;
    Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.

``share_from_rank0`` hands rank 0's value (the NCCL id) to every rank over one TCP port of rank 0's
host, without MPI or PyTorch: rank 0 serves it at MASTER_ADDR (default 127.0.0.1) on CUPY_FLASH_PORT,
else MASTER_PORT + 1 (torchrun's agent and torch.distributed's env:// keep MASTER_PORT itself),
else 29501. Each rank connects with the job's id (TORCHELASTIC_RUN_ID, CUPY_FLASH_RUN_ID, or none)
and its rank, so a server left by another job, or two ranks claiming one number, is an error and
not a silent mix-up.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import typing

# (rank, world size, local rank) variables of each launcher, in the order they are read
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
DEFAULT_PORT = 29501


class Place(typing.NamedTuple):
    """A process's place in the job: its rank, the number of ranks, its rank on its host (which GPU
    it takes), and the launcher variable its rank came from ('' when none was set)."""

    rank: int
    world: int
    local_rank: int
    source: str


def launch_environment(environ=None) -> Place:
    """This process's Place from the first launcher whose rank and world size variables are both
    set (LAUNCHER_VARIABLES); without a local rank, the rank. (0, 1, 0, '') where none is. A value
    that is not an integer, or a rank outside [0, world), is a ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    for rank_name, world_name, local_name in LAUNCHER_VARIABLES:
        if rank_name in environ and world_name in environ:
            rank, world = _integer(environ, rank_name), _integer(environ, world_name)
            local = _integer(environ, local_name) if local_name in environ else rank
            if world < 1 or not 0 <= rank < world:
                raise ValueError(f"{rank_name}={rank} with {world_name}={world}: expected 0 <= rank < world >= 1")
            if local < 0:
                raise ValueError(f"{local_name}={local}: expected a rank on this host >= 0")
            return Place(rank, world, local, rank_name)
    return Place(0, 1, 0, "")


def _integer(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r}: expected an integer") from None


def rendezvous_address(environ=None) -> tuple[str, int]:
    """(host, port) where rank 0 serves its value: MASTER_ADDR (127.0.0.1) and CUPY_FLASH_PORT, or
    MASTER_PORT + 1, or DEFAULT_PORT."""
    environ = os.environ if environ is None else environ
    host = environ.get("MASTER_ADDR") or "127.0.0.1"
    if environ.get("CUPY_FLASH_PORT"):
        port = _integer(environ, "CUPY_FLASH_PORT")
    elif environ.get("MASTER_PORT"):
        port = _integer(environ, "MASTER_PORT") + 1
    else:
        port = DEFAULT_PORT
    if not 0 < port < 65536:
        raise ValueError(f"rendezvous port {port}: expected 1 to 65535 (CUPY_FLASH_PORT, MASTER_PORT + 1)")
    return host, port


def job_id(environ=None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get("TORCHELASTIC_RUN_ID") or environ.get("CUPY_FLASH_RUN_ID") or ""


def share_from_rank0(place: Place, make, address: tuple[str, int], job: str = "", timeout: float = 300.0):
    """``make()``'s value (JSON-able) on rank 0, returned on every rank of ``place``'s job: rank 0
    listens at ``address`` until each other rank has connected with ``job`` and a distinct rank,
    then sends it to all; the others connect (retrying while rank 0 is not up yet). TimeoutError
    after ``timeout`` seconds, naming the ranks that did not come or the address not reached."""
    if place.world == 1:
        return make()
    if place.rank == 0:
        return _serve(make(), place.world, address, job, timeout)
    return _fetch(place.rank, address, job, timeout)


def _send(connection, payload: dict) -> None:
    data = json.dumps(payload).encode()
    connection.sendall(struct.pack("!I", len(data)) + data)


def _receive(connection) -> dict:
    (size,) = struct.unpack("!I", _exactly(connection, 4))
    return json.loads(_exactly(connection, size))


def _exactly(connection, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection mid-message")
        data += chunk
    return data


def _serve(value, world: int, address: tuple[str, int], job: str, timeout: float):
    deadline = time.monotonic() + timeout
    waiting: dict = {}   # rank -> connection
    # loopback stays loopback; another MASTER_ADDR is served on every interface (as torch's store is)
    bind = address[0] if address[0] in ("127.0.0.1", "localhost") else ""
    with socket.create_server((bind, address[1])) as server:
        try:
            while len(waiting) < world - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, world)) - set(waiting))
                    raise TimeoutError(f"rank 0 waited {timeout:.0f} s at {address[0]}:{address[1]} "
                                       f"for ranks {missing}") from None
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                hello = _receive(connection)
                rank = hello.get("rank")
                if hello.get("job") != job or not isinstance(rank, int) or not 0 < rank < world or rank in waiting:
                    _send(connection, {"error": f"rank 0 of job {job!r} (world {world}) refuses rank {rank!r} of job "
                                                f"{hello.get('job')!r}" + (" (taken)" if rank in waiting else "")})
                    connection.close()
                    if hello.get("job") == job and rank in waiting:
                        raise ValueError(f"two processes claim rank {rank}")
                    continue
                waiting[rank] = connection
            for connection in waiting.values():
                _send(connection, {"value": value})
        finally:
            for connection in waiting.values():
                connection.close()
    return value


def _fetch(rank: int, address: tuple[str, int], job: str, timeout: float):
    deadline, pause = time.monotonic() + timeout, 0.05
    while True:
        try:
            connection = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.001))
            break
        except OSError:
            if time.monotonic() + pause > deadline:
                raise TimeoutError(f"rank {rank} could not reach rank 0 at {address[0]}:{address[1]} in {timeout:.0f} s"
                                   " (MASTER_ADDR, CUPY_FLASH_PORT / MASTER_PORT + 1)") from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
    where = f"rank 0 at {address[0]}:{address[1]}"
    with connection:
        connection.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            _send(connection, {"job": job, "rank": rank})
            reply = _receive(connection)
        except TimeoutError:
            raise TimeoutError(f"rank {rank}: {where} sent nothing in {timeout:.0f} s") from None
        except OSError as error:   # reset or closed mid-message: rank 0 stopped (failed, or timed out)
            raise ConnectionError(f"rank {rank}: {where} closed the connection before sending its value "
                                  f"({error}); see rank 0's own error") from None
    if "error" in reply:
        raise ValueError(reply["error"])
    return reply["value"]


def free_port_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port P of ``host`` such that P and P + 1 were free just now (MASTER_PORT for whatever else
    the job runs, P + 1 for share_from_rank0)."""
    for _ in range(tries):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no two consecutive free ports on {host} in {tries} tries")


def launch(command: list, processes: int, port: int | None = None, environ=None, poll: float = 0.1) -> int:
    """Run ``command`` (a script and its arguments, or ``-m module ...``) as ``processes`` Python
    processes on this host, each with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
    (127.0.0.1), MASTER_PORT (``port`` or a free one) and CUPY_FLASH_RUN_ID set, as torchrun sets
    them. When one exits with a failure the others are stopped (SIGTERM, then SIGKILL after 10 s).
    Returns the first failure's exit status, else 0."""
    import secrets
    import subprocess
    import sys

    environ = dict(os.environ if environ is None else environ)
    port = free_port_pair() if port is None else port
    environ.update(WORLD_SIZE=str(processes), LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUPY_FLASH_RUN_ID=secrets.token_hex(8))
    children = [subprocess.Popen([sys.executable, *command], env=dict(environ, RANK=str(rank), LOCAL_RANK=str(rank)))
                for rank in range(processes)]
    status = 0
    try:
        while True:
            codes = [child.poll() for child in children]   # every child polled (no short circuit)
            failed = [code for code in codes if code not in (None, 0)]
            if failed or None not in codes:
                status = failed[0] if failed else 0
                break
            time.sleep(poll)
    finally:
        _stop(children)
    return status


def _stop(children) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + 10.0
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception:   # noqa: BLE001 - still running: killed
            child.kill()
            child.wait()
