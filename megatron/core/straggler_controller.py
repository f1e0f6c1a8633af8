"""The straggler detector's on/off switch over HTTP (Megatron's `--straggler-ctrlr-port`).

Rank 0 listens on a TCP port; any HTTP request to it (e.g. `curl 127.0.0.1:65535`) asks to flip
the detector between collecting and idle. The flip takes effect at the next `report()`, where
rank 0 broadcasts the new state so every rank switches at the same iteration. Megatron listens
on every interface; here the default host is 127.0.0.1 (pass another host to expose it).
"""

import logging
import socket
import threading
from typing import Optional

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2  # how often the listener checks for stop(); bounds stop()'s wait


class StragglerController:
    """A daemon thread answering HTTP requests on `host:port` by raising a toggle flag.

    Args:
        is_off: called for the current state when answering (True = idle), so the reply says
            which way the next report will switch.
    """

    def __init__(self, is_off):
        self._is_off = is_off
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._toggle = threading.Event()
        self.port: Optional[int] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, port: int, host: str = '127.0.0.1') -> bool:
        """Listen on host:port (port 0: any free port, see `.port`); False if it cannot bind,
        which leaves training running without the switch, as in Megatron."""
        self.stop()
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(16)
            sock.settimeout(_ACCEPT_POLL_S)
        except OSError as err:
            logger.warning(f'StragglerDetector cannot be controlled on {host}:{port}: {err}')
            return False
        self._sock, self.port = sock, sock.getsockname()[1]
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name='straggler-ctrlr', daemon=True)
        self._thread.start()
        logger.info(
            f'StragglerDetector controller listening on {host}:{self.port}; current state '
            f'{"OFF" if self._is_off() else "ON"}'
        )
        return True

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:  # the socket was closed by stop()
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                    self._toggle.set()
                    target = 'ON' if self._is_off() else 'OFF'
                    msg = f'Will turn StragglerDetector {target} at next logging interval'
                    conn.sendall(
                        f'HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}'
                        f'\r\n\r\n{msg}'.encode()
                    )
                    logger.info(msg)
                except OSError as err:  # a client that went away: keep serving
                    logger.warning(f'StragglerDetector controller: {err}')

    def take_toggle(self) -> bool:
        """Whether a flip was requested since the last call (and clear the request)."""
        requested = self._toggle.is_set()
        self._toggle.clear()
        return requested

    def stop(self, timeout: float = 2.0) -> None:
        """Close the port and wait (at most `timeout` s) for the thread to end."""
        self._stopping.set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._toggle.clear()
