"""Free loopback ports for the servers tests start (Ray heads, Prometheus, rendezvous)."""
import socket

_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not given before by this process: ports asked for together are
    bound later (by Ray's components), and the kernel may offer a port just released again."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
