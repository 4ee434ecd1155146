"""Process bootstrap: who am I (MPI, srun, torchrun or a single process), which GPU, the
rendezvous, the checks every rank must agree on, the process group, and ending the whole job.

The control plane is a torch TCPStore that rank 0 hosts: the rendezvous, the agreement on the
config, the reports and the verdict go through it. The data plane is the process group, which
only the layer uses (one all-reduce).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import ConfigError
from .errors import rank_ranges as _ranges

# Set in every rank by an MPI launcher: Open MPI's mpirun (OMPI_COMM_WORLD_*, PMIX_RANK), MPICH's hydra
# mpiexec/mpirun and Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), srun --mpi=pmi2 or
# pmix, MVAPICH (MV2_COMM_WORLD_*).
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


class LaunchError(RuntimeError):
    """The launch itself is wrong (a missing package, a rendezvous that never completes)."""


@dataclass
class Proc:
    launcher: str = "single"        # mpi, srun, torchrun or single
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    hostname: str = field(default_factory=socket.gethostname)
    comm: object = None             # mpi4py COMM_WORLD under MPI
    store: object = None            # the control-plane store once rendezvous() ran
    device: object = None           # set by init_distributed()
    peers: list = field(default_factory=list)  # every rank's info once agree() ran

    def dead_peers(self) -> str:
        """After a failed collective: which ranks on this host have exited (their pid is gone)."""
        gone = []
        for r, info in enumerate(self.peers):
            if r != self.rank and info.get("host") == self.hostname and info.get("pid") \
                    and not _process_alive(info["pid"]):
                gone.append(r)
        return f"rank(s) {_ranges(gone)} on {self.hostname} exited" if gone else ""

    @property
    def distributed(self) -> bool:
        return self.launcher != "single"

    def abort(self, code: int) -> None:
        """End this process and, under MPI, the whole job."""
        _last_words()
        if self.comm is not None and self.world > 1:
            self.comm.Abort(code)
        os._exit(code)


def exit_now(code: int) -> None:
    """End the process with `code` without the interpreter's finalization (after MPI_Finalize
    when MPI is up, so mpirun sees a normal exit). torch's gloo worker threads may still be
    releasing a collective's tensors at exit, and a release that needs the interpreter while it
    finalizes aborts the process (seen with torch 2.13: "terminate called without an active
    exception" after a run that passed, about 1 in 10 runs after chunked or sequence-parallel
    collectives).

    With MPI up, the end is the C library's exit(), not os._exit(): the MPI library's own exit
    handlers must run. MPICH (4.1 and later, the mpich wheel's 5.0) leaves the connection to its
    launcher open in MPI_Finalize and closes it, with PMI's "finalize", in an atexit() handler;
    a rank that ends by _exit() closes that connection without it, which hydra takes for a rank
    that died: it sends SIGKILL to every other rank of the node still running (rank 0, which
    leaves last, most often; "BAD TERMINATION ... EXIT CODE: 9" after RESULT: PASS). exit()
    runs the C handlers and destructors, as any program's exit after MPI_Finalize does, but
    not Python's finalization, which is what this function avoids."""
    _last_words()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized():
        if not MPI.Is_finalized():
            MPI.Finalize()
        _c_exit(code)
    os._exit(code)


_BEFORE_EXIT: list = []  # what a rank must do once its output is out and before it exits


def _last_words() -> None:
    """stdout and stderr flushed, then _BEFORE_EXIT's waits, once: from exit_now and Proc.abort
    (which skip Python's atexit), and from atexit (a script that returns, or ends by a traceback)."""
    sys.stdout.flush()
    sys.stderr.flush()
    while _BEFORE_EXIT:
        _BEFORE_EXIT.pop()()


atexit.register(_last_words)


def _c_exit(code: int) -> None:
    """The C library's exit(code): atexit() handlers, C++ static destructors, C stdio flushed;
    not the interpreter's finalization (no Python atexit, no module teardown). Returns only where
    there is no C exit() to call (then the caller's os._exit ends the process)."""
    try:
        import ctypes
        libc_exit = ctypes.PyDLL(None).exit  # the process's own C library; PyDLL: called holding the GIL
    except (ImportError, OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return
    libc_exit.argtypes, libc_exit.restype = [ctypes.c_int], None
    libc_exit(code)  # holding the GIL (PyDLL): a C++ destructor at exit that calls into Python has it
    # (through ctypes.CDLL, which releases it, torch's thread-local destructors aborted the process:
    # "PyThreadState_Get: the function must be called with the GIL held", scripts/peer_tp.py every run)


def _process_alive(pid: int) -> bool:
    """False once the process has exited, also while it is a zombie its launcher has not reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v in (None, ""):
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r} is not an integer (a launcher sets it: unset it, or give a number)") from None


def _slurm_tasks_on_node(spec: str, node: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE like '2(x3),1' -> tasks on node index `node`."""
    counts: list[int] = []
    for part in spec.split(","):
        if "(x" in part:
            n, rep = part.rstrip(")").split("(x")
            counts += [int(n)] * int(rep)
        else:
            counts.append(int(part))
    return counts[node] if node < len(counts) else counts[-1]


class _NoMpiRendezvous:
    """The ranks of one node meeting without MPI: a file each in a folder named after the
    launcher's process on this node (its pid and start time: a pid used again later is another
    folder) and the job's PMIx namespace where the launcher sets one (a daemon that outlives one
    job, PRRTE's DVM, starts others). wait(step) marks this rank at `step` and returns when every
    local rank is there, or after RENDEZVOUS_S (a rank that never comes does not hold the others);
    leave() after the last step removes the folder."""

    RENDEZVOUS_S = 10.0

    def __init__(self, rank: str, local: int | None):
        self.local, self.here = local or 1, None
        self.name = rank if rank != "?" else str(os.getpid())
        if self.local > 1:
            import tempfile
            launcher = str(os.getppid())
            try:
                with open(f"/proc/{launcher}/stat") as f:
                    launcher += "-" + f.read().rsplit(")", 1)[1].split()[19]
            except (OSError, IndexError):
                pass
            job = "".join(c if c.isalnum() else "_" for c in os.environ.get("PMIX_NAMESPACE", ""))
            self.here = os.path.join(tempfile.gettempdir(), f"tpattn-nompi-{os.getuid()}-{launcher}"
                                                            + (f"-{job}" if job else ""))

    def wait(self, step: str) -> None:
        if self.here is None:
            return
        folder = os.path.join(self.here, step)
        deadline = time.monotonic() + self.RENDEZVOUS_S
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, self.name), "w").close()
            while len(os.listdir(folder)) < self.local and time.monotonic() < deadline:
                time.sleep(0.01)
        except OSError:
            pass

    def leave(self) -> None:
        """One more step, "gone", then the folder removed: every rank is past its waits by then (a
        rank that removed it after only its own step could be killed first: the launcher ends the
        others when one exits)."""
        if self.here is None:
            return
        import shutil
        self.wait("gone")  # (a rank still polling when another has removed the folder stops at its OSError)
        shutil.rmtree(self.here, ignore_errors=True)


def _launcher_rank() -> str:
    """This process's rank as the MPI launcher's variables say it (no MPI needed), or '?'."""
    env = os.environ
    return env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK") or env.get("PMIX_RANK") or "?"


def _refusal_without_mpi(message: str) -> ConfigError:
    """The error of a rank that has no MPI to abort the job with (no library, or another MPI's, which
    makes it a world of 1). The launcher ends the job, with SIGKILL, when the first rank exits, and
    what a rank had not yet written is lost (a rank that printed its line 50 ms after another had
    exited lost it): so every rank must print before any exits. A rank here ignores the launcher's
    SIGTERM, waits until the other ranks of its node are here too, and, once its line is out (on its
    way out of the process, whichever way the caller ends it: _last_words), until they have printed
    theirs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    meet = _NoMpiRendezvous(_launcher_rank(), _env_int("OMPI_COMM_WORLD_LOCAL_SIZE", _env_int("MPI_LOCALNRANKS")))
    meet.wait("here")
    _BEFORE_EXIT.append(lambda: (meet.wait("said"), meet.leave()))
    return ConfigError(message)


def discover() -> Proc:
    """Rank, world and local rank from MPI, then srun, then torchrun, else a single process."""
    env = os.environ
    port = _env_int("MASTER_PORT")  # read by every rank here, before any rank communicates
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    if any(k in env for k in MPI_ENV):
        fix = ("pip install 'tpattn[mpi]' (Open MPI wheel, with its mpirun) or 'tpattn[mpich]' (MPICH wheel, with "
               "its mpiexec), or point mpi4py at your cluster's MPI: module load it, or export "
               "MPI4PY_LIBMPI=/path/to/libmpi.so")
        # the launcher's world size, checked against MPI's own: another MPI's library makes each rank a world of 1
        size_var = next((k for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE") if k in env), None)
        try:
            import warnings
            with warnings.catch_warnings():  # mpi4py's "suspicious MPI execution environment": checked below
                warnings.simplefilter("ignore", RuntimeWarning)
                from mpi4py import MPI
        except ImportError as exc:
            if exc.name != "mpi4py":  # mpi4py is there, its MPI extension is not loadable
                problem = f"mpi4py cannot load its MPI module ({str(exc).strip().splitlines()[0]})"
            elif "SLURM_PROCID" in env:  # srun without mpi4py: SLURM's variables below
                problem = None
            else:
                raise ConfigError("launched under MPI but mpi4py is not installed: pip install 'tpattn[mpi]'")
        except (RuntimeError, OSError) as exc:  # mpi4py 4: no libmpi.so.40 / .so.12 found (or it failed to load)
            lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
            problem = f"mpi4py finds no MPI library to load ({lines[-1]})"
        else:
            problem = None
            comm = MPI.COMM_WORLD
            rank, world = comm.Get_rank(), comm.Get_size()
            launched = _env_int(size_var) if size_var else None
            if launched is not None and launched != world:
                try:  # "Open MPI v5.0.11" / "MPICH Version: 5.0.2", and the file where the system has /proc
                    lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
                    with open("/proc/self/maps") as f:
                        libs = {ln.split()[-1] for ln in f if "/libmpi" in ln}
                    lib += f" ({', '.join(sorted(libs))})" if libs else ""
                except Exception:  # noqa: BLE001 - only for the message
                    lib = lib if "lib" in locals() else "an MPI library"
                raise _refusal_without_mpi(f"the launcher started {launched} ranks ({size_var}={launched}) but MPI says this "
                                  f"process is rank {rank} of {world}: mpi4py loaded {lib}, which does not belong "
                                  f"to this launcher; use the launcher of that MPI, or {fix}")
            local_rank = local_world = None  # Open MPI's, then MPICH's / Intel MPI's, else a shared-memory split
            for rank_var, local_size_var in (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                                             ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
                local_rank, local_world = _env_int(rank_var), _env_int(local_size_var)
                if local_rank is not None and local_world is not None:
                    break
            if local_rank is None or local_world is None:
                node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
                local_rank, local_world = node.Get_rank(), node.Get_size()
                node.Free()
            return Proc("mpi", rank, world, local_rank, local_world, comm=comm)
        if problem and "SLURM_PROCID" not in env:
            where = f"rank {_launcher_rank()}" + (f" of {env[size_var]}" if size_var else "")
            raise _refusal_without_mpi(f"launched under MPI ({where}) but {problem}: {fix}")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and "SLURM_STEP_ID" in env:
        world = _env_int("SLURM_STEP_NUM_TASKS")
        node = _env_int("SLURM_NODEID", 0)
        spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
        return Proc("srun", _env_int("SLURM_PROCID"), world, _env_int("SLURM_LOCALID", 0),
                    _slurm_tasks_on_node(spec, node))
    if "RANK" in env and "WORLD_SIZE" in env:
        world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        if world is None or rank is None or world < 1 or not 0 <= rank < world:
            raise ConfigError(f"RANK={env['RANK']!r} of WORLD_SIZE={env['WORLD_SIZE']!r}: the world needs at least one "
                              "rank and each rank a number below it (torchrun sets both; unset them for one process)")
        return Proc("torchrun", rank, world, _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world))
    return Proc()


def pick_device(proc: Proc, device: str) -> torch.device:
    """Local rank picks the GPU (ranks beyond the GPU count share them round-robin: gloo only)."""
    if device != "cuda":
        return torch.device("cpu")
    idx = proc.local_rank % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def ranks_on_device(proc: Proc) -> int:
    """How many ranks of this node share this rank's GPU (pick_device's round-robin): 1 with a GPU per
    rank, more when the local ranks outnumber the GPUs (gloo)."""
    count = max(torch.cuda.device_count(), 1)
    return len(range(proc.local_rank % count, max(proc.local_world, 1), count))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        import subprocess
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=20, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = nodelist.split(",")[0]
    if "[" in head:  # node[01-04] -> node01
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head or "127.0.0.1"


def _mpi_wait(req, deadline: float, timeout: float) -> None:
    """Poll a non-blocking MPI request: a rank that never starts must not hang the others."""
    while not req.Test():
        if time.monotonic() > deadline:
            raise LaunchError(f"the MPI rendezvous did not complete within {timeout:g} s: a rank has not started "
                              "or hangs before it (see the launcher's log; --timeout sets the wait)")
        time.sleep(0.01)


def _mpi_address(proc: Proc, timeout: float) -> tuple[str, int]:
    """Rank 0 picks the store's address and a free port and sends them to all: no env needed."""
    from mpi4py import MPI
    width, deadline = 256, time.monotonic() + timeout
    mine = proc.hostname.encode()[:width].ljust(width, b"\0")
    hosts = bytearray(width * proc.world)
    _mpi_wait(proc.comm.Iallgather([mine, MPI.BYTE], [hosts, MPI.BYTE]), deadline, timeout)
    names = {bytes(hosts[i * width:(i + 1) * width]).rstrip(b"\0") for i in range(proc.world)}
    msg = bytearray(width)
    if proc.rank == 0:
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(names) == 1
                                                 else socket.gethostbyname(proc.hostname))
        port = _env_int("MASTER_PORT") or _free_port()
        msg[:] = f"{addr} {port}".encode().ljust(width, b"\0")
    _mpi_wait(proc.comm.Ibcast([msg, MPI.BYTE], root=0), deadline, timeout)
    addr, port = bytes(msg).rstrip(b"\0").decode().split()
    return addr, int(port)


def _rendezvous_address(proc: Proc, timeout: float) -> tuple[str, int]:
    env = os.environ
    if proc.launcher == "mpi":
        return _mpi_address(proc, timeout)
    if proc.launcher == "srun":
        single_node = _env_int("SLURM_STEP_NUM_NODES", _env_int("SLURM_NNODES", 1)) == 1
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if single_node else _first_slurm_host())
        port = _env_int("MASTER_PORT") or 20000 + (_env_int("SLURM_JOB_ID", 0) * 7 + _env_int("SLURM_STEP_ID", 0)) % 20000
        return addr, port
    return env.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT", 29500)


def rendezvous(proc: Proc, timeout: float) -> None:
    """Start (rank 0) or join the control-plane store. Sets proc.store."""
    if not proc.distributed:
        proc.store = dist.HashStore()
        return
    addr, port = _rendezvous_address(proc, timeout)
    # Under torchrun the agent already hosts a store at MASTER_ADDR:MASTER_PORT: join it.
    host = proc.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(addr, port, proc.world, is_master=host, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - turned into one line
        raise LaunchError(f"could not reach the rendezvous at {addr}:{port} within {timeout:g} s "
                          f"({type(exc).__name__}); is rank 0 running? set MASTER_ADDR/MASTER_PORT if the "
                          "default address is wrong") from None
    proc.store = dist.PrefixStore("tpattn", store)


def exchange(proc: Proc, key: str, payload: dict, timeout: float, what: str) -> list[dict]:
    """Every rank publishes `payload` under `key`; returns all ranks' payloads, by rank.

    Waits at most `timeout` seconds, then names the ranks that never answered."""
    store = proc.store
    store.set(f"{key}/{proc.rank}", json.dumps(payload))
    keys = [f"{key}/{r}" for r in range(proc.world)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            from . import watch  # they may wait in a collective this rank never joined
            why = watch.blame(missing)
            if why:
                raise LaunchError(why)
            raise LaunchError(f"rank(s) {_ranges(missing)} did not reach the {what} within {timeout:g} s "
                              "(did they start, or did they die? see the launcher's log; --timeout sets the wait)")
        time.sleep(0.05)
    return [json.loads(store.get(k)) for k in keys]


def wait_for(proc: Proc, key: str, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while not proc.store.check([key]):
        if time.monotonic() > deadline:
            raise LaunchError(f"rank 0 did not publish the {what} within {timeout:g} s")
        time.sleep(0.05)
    return json.loads(proc.store.get(key))


def leave(proc: Proc, timeout: float, code: int) -> None:
    """The last step of every rank, once its exit status is decided: a barrier on the store.

    No rank exits before every rank has decided its status and arrived here, and from here a
    SIGTERM (srun --kill-on-bad-exit or mpirun ending the job because another rank exited
    non-zero) makes the rank exit with that status instead of dying by the signal. Rank 0 hosts
    the store, so it leaves last, after the others have said they no longer use it."""
    if not proc.distributed:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    deadline = time.monotonic() + timeout

    def wait(keys):
        while keys and not proc.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.01)

    proc.store.set(f"done/{proc.rank}", "1")
    wait([f"done/{r}" for r in range(proc.world)])
    if proc.rank != 0:
        proc.store.set(f"gone/{proc.rank}", "1")  # this rank's last use of the store
        return
    wait([f"gone/{r}" for r in range(1, proc.world)])


def agree(proc: Proc, fingerprint: dict | None, local_error: str | None, info: dict, timeout: float):
    """The decision every rank takes together before any collective.

    Returns (error or None, all ranks' info). The error is the lowest rank's own, or a list of
    arguments that differ between ranks."""
    everyone = exchange(proc, "agree", {"fp": fingerprint, "err": local_error, "info": info}, timeout,
                        "rendezvous")
    infos = [e["info"] for e in everyone]
    failed = [(r, e["err"]) for r, e in enumerate(everyone) if e["err"]]
    if failed:
        ranks = [r for r, _ in failed]
        msg = failed[0][1]
        return (msg if len(ranks) == proc.world else f"{msg} (on rank(s) {_ranges(ranks)})"), infos
    ref = everyone[0]["fp"]
    for r, e in enumerate(everyone):
        diff = [k for k in ref if e["fp"].get(k) != ref[k]]
        if diff == ["load_sha256"]:
            return (f"--load {ref.get('load')} holds different contents on rank 0 and rank {r} (a relative path, or "
                    "files that differ between nodes): give every rank the same file"), infos
        if diff:
            shown = "; ".join(f"{k}: rank 0 has {ref[k]!r}, rank {r} has {e['fp'].get(k)!r}" for k in diff[:3])
            return f"arguments differ between ranks ({shown}); launch every rank with the same arguments", infos
    proc.peers = infos
    return None, infos


def init_process_group(proc: Proc, backend: str, device: torch.device, timeout: float) -> None:
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=dist.PrefixStore("pg", proc.store), rank=proc.rank,
                            world_size=proc.world, timeout=timedelta(seconds=timeout), **kw)


def init_distributed(backend: str = "auto", timeout: float = 300.0) -> Proc:
    """For API users: discover the launcher, pick this rank's device, rendezvous and create the
    default process group (nccl on a GPU, gloo otherwise). Returns the Proc (rank, world, ...)."""
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"init_distributed: backend must be 'auto', 'nccl' or 'gloo' (got {backend!r})")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: backend 'nccl' needs a CUDA GPU, and torch sees none here; use 'gloo' "
                         "(or 'auto')")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 86400 * 365:
        raise ValueError(f"init_distributed: timeout must be a positive number of seconds (got {timeout!r})")
    proc = discover()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = pick_device(proc, "cuda" if backend == "nccl" or torch.cuda.is_available() else "cpu")
    rendezvous(proc, timeout)
    if proc.distributed:
        init_process_group(proc, backend, device, timeout)
    proc.device = device
    return proc
