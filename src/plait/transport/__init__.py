"""Transports: shared memory between ranks of one host, TCP between hosts."""
