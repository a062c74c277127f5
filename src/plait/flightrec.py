"""The flight recorder: the last collectives of one communicator, for post-mortems.

Every collective is written into a preallocated ring of ``PLAIT_FLIGHT_RECORDER_ENTRIES``
slots (rounded up to a power of two) when it is issued, and stamped when it starts and
ends (a synchronous operation is issued as it starts: one stamp). The hot path does no
formatting, takes no lock and allocates one small list: the
slot is ``[seq, op, bytes, dtype, algorithm, issued, started, ended, error]`` with
``time.monotonic()`` stamps, converted to wall-clock time only when the record is read
(``Communicator.flight_record()``, a timeout, ``plait flightrec``). A reader racing the
writer may see the newest slot half-written; the record is a diagnostic, not a log.

Only collectives (the operations that take a sequence number) are recorded;
point-to-point messages are not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("plait")

# slot fields
SEQ, OP, NBYTES, DTYPE, ALGO, ISSUED, STARTED, ENDED, ERROR = range(9)


class FlightRecorder:
    __slots__ = ("mask", "size", "slots")

    def __init__(self, entries: int) -> None:
        size = 16
        while size < entries:
            size <<= 1
        self.size = size
        self.mask = size - 1
        self.slots: list[list[Any] | None] = [None] * size

    # The hot path (Communicator._submit / _execute) writes slots directly; these helpers
    # are for the slow paths and for tests.

    def slot(self, seq: int) -> list[Any] | None:
        s = self.slots[seq & self.mask]
        return s if s is not None and s[SEQ] == seq else None

    def op_name(self, seq: int) -> str:
        """The operation recorded as ``seq`` ("op" if it has rotated out)."""
        s = self.slot(seq)
        return str(s[OP]) if s is not None else "op"

    def records(self) -> list[dict[str, Any]]:
        """Every recorded operation, oldest first, as plain dicts."""
        now_mono, now_wall = time.monotonic(), time.time()

        def wall(t: float) -> float | None:  # 0.0: not (yet) stamped
            return round(now_wall - (now_mono - t), 6) if t else None

        out = []
        for s in list(self.slots):
            if s is None:
                continue
            seq, op, nbytes, dtype, algo, issued, started, ended, error = s
            issued = issued or started  # synchronous ops are issued as they start
            if error is not None:
                state = "failed"
            elif ended:
                state = "done"
            elif started:
                state = "running"
            else:
                state = "queued"
            out.append({
                "seq": seq, "op": op, "bytes": nbytes,
                "dtype": getattr(dtype, "name", dtype), "algorithm": algo, "state": state,
                "issued": wall(issued), "started": wall(started), "ended": wall(ended),
                "duration_us": round((ended - started) * 1e6, 1) if ended and started
                else None,
                "waiting_s": round(now_mono - started, 3) if started and not ended
                and error is None else None,
                "error": error,
            })
        out.sort(key=lambda r: r["seq"])
        return out


def format_records(records: list[dict[str, Any]], last: int = 16) -> str:
    """A compact table of the newest ``last`` records, for logs."""
    lines = []
    for r in records[-last:]:
        extra = ""
        if r["state"] == "done":
            extra = f"{r['duration_us']:.0f} us"
        elif r["state"] == "running":
            extra = f"running for {r['waiting_s']:.1f} s"
        elif r["state"] == "failed":
            extra = str(r["error"])[:120]
        nbytes = r["bytes"] if r["bytes"] is not None else "-"
        lines.append(f"  #{r['seq']:<6} {r['op']:<15} {nbytes:>10} B {r['dtype'] or '-':<9} "
                     f"{r['algorithm'] or '-':<8} {r['state']:<8} {extra}")
    return "\n".join(lines)


def dump(directory: str, rank: int, uid: str, records: list[dict[str, Any]],
         reason: str) -> str | None:
    """Write ``records`` to ``<directory>/plait-flightrec-<uid>-r<rank>-<pid>.json``."""
    if not directory:
        return None
    path = os.path.join(directory, f"plait-flightrec-{uid}-r{rank}-{os.getpid()}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "communicator": uid,
                       "reason": reason, "time": time.time(), "records": records}, f,
                      indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("rank %d: could not write the flight record to %s: %s", rank, path, exc)
        return None
    return path
