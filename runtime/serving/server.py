"""Run the service with uvicorn: listen (port 0 picks a free port), and on SIGTERM or SIGINT stop accepting, let
the requests in flight finish (up to serve.drain_timeout_s), stop the worker and return, so the process exits 0.
`BackgroundServer` runs the same server on a thread, for tests and embedding."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import uvicorn

from runtime.errors import UserError
from runtime.serving.app import build_app
from runtime.serving.service import Service

log = logging.getLogger("moesys.serve")
EXIT_GRACE_S = 10.0
"""How long past serve.drain_timeout_s a stopping server thread may take to close its connections."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that a stop signal is not raised again once the server has drained (uvicorn
    re-raises it, which would end the process with the signal's status instead of 0); a second signal stops the
    waiting at once."""

    def handle_exit(self, sig: int, frame) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); a one-line UserError when that is impossible."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections wait in the backlog until the event loop accepts them
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name that is no valid IDNA name
        if sock is not None:
            sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"cannot listen on {host}:{port}: {reason}; choose another serve.host or "
                        "--port (0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(service: Service) -> DrainingServer:
    # uvicorn annotates the drain timeout int, but uses it as an asyncio timeout, which takes a float.
    drain_s: float = service.config.serve.drain_timeout_s
    config = uvicorn.Config(build_app(service), loop="asyncio", http="h11", lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=drain_s)  # type: ignore[arg-type]
    return DrainingServer(config)


def serve(service: Service, on_listen: Callable[[str], None] | None = None) -> None:
    """Serve on serve.host:serve.port until SIGTERM/SIGINT, then drain and close the service."""
    try:
        sock = listen_socket(service.config.serve.host, service.config.serve.port)
        if on_listen is not None:
            on_listen(address(sock))
        _server(service).run(sockets=[sock])
    finally:
        service.close()


class BackgroundServer:
    """The server on a thread of this process (no signal handling): `with BackgroundServer(service) as url:`;
    leaving the block drains the requests in flight and closes the service."""

    def __init__(self, service: Service):
        self.service = service
        self.sock = None
        try:
            self.sock = listen_socket(service.config.serve.host, service.config.serve.port)
            self.url = address(self.sock)
            self.server = _server(service)
        except BaseException:  # nobody else will close them: the caller never gets this object
            if self.sock is not None:
                self.sock.close()
            service.close()
            raise
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="moesys-serve", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        drain = self.service.config.serve.drain_timeout_s
        self.server.should_exit = True
        self.thread.join(drain + EXIT_GRACE_S)  # uvicorn cancels what still runs after drain_timeout_s
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(EXIT_GRACE_S)
        if self.thread.is_alive():
            log.warning("the server thread did not stop within serve.drain_timeout_s=%gs + %gs", drain,
                        2 * EXIT_GRACE_S)
        self.service.close()
