"""How a rank ends: tpattn.dist.exit_now, the last call of `python -m tpattn` and of the MPI scripts.

With MPI up, exit_now must end the process through the C library's exit(), after MPI_Finalize:
MPICH (4.1 and later: the mpich wheel) closes its connection to hydra, with PMI's "finalize", in
an atexit() handler, and a rank that ends by os._exit() skips it; hydra then takes the rank for
dead and sends SIGKILL to the other ranks still running ("BAD TERMINATION ... EXIT CODE: 9" after
RESULT: PASS, tests/test_fresh_install.py). Python's finalization stays skipped (gloo's worker
threads may still need the interpreter: see exit_now). Here without any MPI: a stand-in for
mpi4py.MPI records the calls, and a C exit handler (glibc's on_exit, which also gets the status)
stands in for MPICH's; tests/test_fresh_install.py runs the real thing under MPICH's mpiexec.
"""

import ctypes
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = r"""
import atexit, ctypes, os, sys, types

mpi_up = sys.argv[1] == "mpi"
state = {"finalized": False}
if mpi_up:  # what exit_now looks at: mpi4py.MPI, imported and initialized
    MPI = types.ModuleType("mpi4py.MPI")
    MPI.Is_initialized = lambda: True
    MPI.Is_finalized = lambda: state["finalized"]
    def finalize():
        state["finalized"] = True
        os.write(1, b"MPI_Finalize\n")
    MPI.Finalize = finalize
    sys.modules["mpi4py.MPI"] = MPI

HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)
handler = HANDLER(lambda status, _: os.write(1, f"C exit handler: status {status}\n".encode()))
assert ctypes.CDLL(None).on_exit(handler, None) == 0  # as MPICH's atexit(MPIR_pmi_finalize_on_exit)
atexit.register(lambda: os.write(1, b"Python atexit\n"))  # runs only in the interpreter's finalization

from tpattn.dist import exit_now
print("exit_now", flush=True)
exit_now(3)
os.write(1, b"returned\n")
"""


def probe(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


needs_on_exit = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "on_exit"),
                                   reason="needs glibc's on_exit to stand in for MPICH's exit handler")


@needs_on_exit
def test_with_mpi_up_the_c_exit_handlers_run_after_mpi_finalize():
    """MPI_Finalize, then the C library's exit(3): its handlers run (MPICH's PMI finalize is one)
    with the status; Python's atexit does not (no interpreter finalization); exit status 3."""
    r = probe("mpi")
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["exit_now", "MPI_Finalize", "C exit handler: status 3"], r.stdout + r.stderr


@needs_on_exit
def test_without_mpi_the_process_ends_without_the_interpreters_finalization():
    """No MPI (a single process, srun or torchrun): the exit status, and no Python atexit."""
    r = probe("single")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Python atexit" not in r.stdout and "returned" not in r.stdout and "MPI_Finalize" not in r.stdout, r.stdout
