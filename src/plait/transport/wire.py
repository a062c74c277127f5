"""plait's TCP wire format, versioned from the first release.

A connection starts with a handshake (magic, protocol version, job id, communicator id,
ranks, stream index, nonces) and an HMAC challenge-response over it with the per-job
secret, in both directions. Then the connector sends frames: a fixed 40-byte header,
validated before any payload byte is accepted, followed by ``length`` payload bytes.
Connections are one-way (the connector sends, the acceptor reads), so neither side ever
waits for the other to read before it can read itself.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from ..errors import TransportError

VERSION = 1
HELLO_MAGIC = b"PLAITHS1"
FRAME_MAGIC = 0x4C50  # "PL"

KIND_COLL = 1  # a piece of a collective's message; tag = message index within the op
KIND_P2P = 2  # a piece of a point-to-point message; tag = the user's tag
KIND_BYE = 3  # orderly close: the sender will send nothing more

MAX_TOTAL = 1 << 44  # largest message accepted (16 TiB): bounds any allocation

_HELLO = struct.Struct("<8sHH16s16sII16s")
_CHALLENGE = struct.Struct("<8s16s32s")
_RESPONSE = struct.Struct("<32s")
HEADER = struct.Struct("<HBBIQQIIQ")
HEADER_SIZE = HEADER.size


@dataclass(frozen=True)
class Hello:
    version: int
    stream: int
    job: bytes
    comm: bytes
    src: int
    dst: int
    nonce: bytes

    def pack(self) -> bytes:
        return _HELLO.pack(HELLO_MAGIC, self.version, self.stream, self.job, self.comm,
                           self.src, self.dst, self.nonce)

    @classmethod
    def unpack(cls, data: bytes) -> Hello:
        _expect_size(data, HELLO_SIZE, "hello")
        magic, ver, stream, job, comm, src, dst, nonce = _HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            raise TransportError("handshake: not a plait connection (bad magic)")
        if ver != VERSION:
            raise TransportError(f"handshake: protocol version {ver}, this side speaks "
                                 f"{VERSION}")
        return cls(ver, stream, job, comm, src, dst, nonce)


HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
RESPONSE_SIZE = _RESPONSE.size


def _expect_size(data: bytes, size: int, what: str) -> None:
    # parsers raise TransportError only, whatever the input (fuzzed in test_reliability)
    if len(data) != size:
        raise TransportError(f"handshake: {what} of {len(data)} bytes, expected {size}")


def mac(secret: bytes, role: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + hello + nonce, hashlib.sha256).digest()


def pack_challenge(secret: bytes, hello: bytes, nonce: bytes) -> bytes:
    return _CHALLENGE.pack(HELLO_MAGIC, nonce, mac(secret, b"S", hello, nonce))


def check_challenge(secret: bytes, hello: bytes, data: bytes) -> bytes:
    """Verify the acceptor's proof; return the response that proves ours."""
    _expect_size(data, CHALLENGE_SIZE, "challenge")
    magic, nonce, proof = _CHALLENGE.unpack(data)
    if magic != HELLO_MAGIC or not hmac.compare_digest(proof, mac(secret, b"S", hello, nonce)):
        raise TransportError("handshake: the acceptor failed authentication (wrong job "
                             "secret?)")
    return _RESPONSE.pack(mac(secret, b"C", hello, nonce))


def check_response(secret: bytes, hello: bytes, nonce: bytes, data: bytes) -> None:
    _expect_size(data, RESPONSE_SIZE, "response")
    (proof,) = _RESPONSE.unpack(data)
    if not hmac.compare_digest(proof, mac(secret, b"C", hello, nonce)):
        raise TransportError("handshake: the connector failed authentication")


@dataclass
class Frame:
    kind: int
    tag: int
    seq: int
    offset: int
    length: int
    total: int


def pack_header(kind: int, tag: int, seq: int, offset: int, length: int, total: int) -> bytes:
    return HEADER.pack(FRAME_MAGIC, VERSION, kind, tag, seq, offset, length, 0, total)


def parse_header(data: bytes | bytearray | memoryview, max_length: int) -> Frame:
    """Validate a frame header; raise TransportError on anything malformed or oversized."""
    if len(data) != HEADER_SIZE:
        raise TransportError(f"frame header of {len(data)} bytes, expected {HEADER_SIZE}")
    magic, ver, kind, tag, seq, offset, length, flags, total = HEADER.unpack(data)
    if magic != FRAME_MAGIC:
        raise TransportError(f"bad frame magic {magic:#x}")
    if ver != VERSION:
        raise TransportError(f"frame version {ver}, expected {VERSION}")
    if kind not in (KIND_COLL, KIND_P2P, KIND_BYE):
        raise TransportError(f"unknown frame kind {kind}")
    if flags != 0:
        raise TransportError(f"unknown frame flags {flags:#x}")
    if length > max_length:
        raise TransportError(f"frame of {length} bytes exceeds the limit of {max_length}")
    if total > MAX_TOTAL or offset + length > total:
        raise TransportError(f"frame [{offset}, {offset + length}) outside a message of "
                             f"{total} bytes")
    if kind == KIND_BYE and (length or total):
        raise TransportError("goodbye frame with a payload")
    return Frame(kind, tag, seq, offset, length, total)
