"""Single-copy transfers between processes of one host (Linux cross-memory attach).

``process_vm_readv`` copies straight from a peer's buffer into ours: one copy instead of
the two of a shared-memory staging ring (measured here: 64 MiB at ~5.3 GB/s, against ~7
GB/s for an in-process copy). A receiver trusts a peer's addresses only after it has read
a random nonce the peer wrote at a published address of its own memory and found it
intact: containers that share /dev/shm but not a PID namespace fail that check and keep
using the ring.
"""

from __future__ import annotations

import ctypes
import errno

_libc = ctypes.CDLL(None, use_errno=True)
try:
    _readv = _libc.process_vm_readv
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                       ctypes.c_ulong, ctypes.c_ulong]
except AttributeError:  # not Linux, or an old libc
    _readv = None


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


AVAILABLE = _readv is not None


class CmaError(OSError):
    pass


def read(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``remote_addr`` in process ``pid`` to ``local_addr`` here."""
    if _readv is None:
        raise CmaError(errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    local = _Iovec()
    remote = _Iovec()
    while done < nbytes:
        local.iov_base = local_addr + done
        local.iov_len = nbytes - done
        remote.iov_base = remote_addr + done
        remote.iov_len = nbytes - done
        n = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"process_vm_readv from pid {pid}: {errno.errorcode.get(err, err)}")
        done += n


def read_word(pid: int, remote_addr: int) -> int | None:
    """One int64 from another process, or None if it cannot be read."""
    buf = ctypes.c_int64(0)
    try:
        read(pid, remote_addr, ctypes.addressof(buf), 8)
    except CmaError:
        return None
    return int(buf.value)
