#!/usr/bin/env python3
"""Round-trip time of a bare loopback TCP exchange between two processes.

The floor under any ext_proc exchange on the machine at hand: a client process sends 200 bytes
and waits for them to come back from a server process, once every GAP seconds (default 0.05,
so that both sides go idle between exchanges, as at 20 requests/s), 400 times; prints p50, p90
and p99. docs/benchmarks.md compares it with the added latency of `make bench-overhead`.

    python3 bench/loopback_rtt.py [GAP_SECONDS]
"""

import os
import socket
import sys
import time

EXCHANGES = 400
PAYLOAD = b"x" * 200


def serve(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(4096)
        if not data:
            os._exit(0)
        conn.sendall(data)


def main() -> None:
    gap = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        serve(listener)
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(EXCHANGES):
        time.sleep(gap)
        started = time.perf_counter()
        client.sendall(PAYLOAD)
        received = 0
        while received < len(PAYLOAD):
            chunk = client.recv(4096)
            if not chunk:
                sys.exit("the echo server closed the connection")
            received += len(chunk)
        rtts.append((time.perf_counter() - started) * 1e6)
    client.close()
    os.waitpid(child, 0)
    rtts.sort()
    at = lambda q: rtts[min(len(rtts) - 1, int(len(rtts) * q))]
    print(
        f"gap {gap * 1e3:.0f} ms, {EXCHANGES} exchanges of {len(PAYLOAD)} bytes: "
        f"RTT p50 {at(0.5):.0f} us, p90 {at(0.9):.0f} us, p99 {at(0.99):.0f} us"
    )


if __name__ == "__main__":
    main()
