"""A TCP proxy in front of a store whose replies pass a token bucket: a slow link / a slow store, made slower or
faster live (``rate``). Threads only; ``close`` stops them and every connection."""

from __future__ import annotations

import socket
import threading

from kvflow.pool.devices.throttle import TokenBucket


class SlowProxy:
    def __init__(self, target_port: int, rate: float | None = None):
        self.target = ("127.0.0.1", target_port)
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = False
        self.rate = rate
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def rate(self) -> float | None:
        return self._bucket.rate if self._bucket else None

    @rate.setter
    def rate(self, value: float | None) -> None:
        self._bucket = TokenBucket(value) if value else None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        import time

        try:
            while data := src.recv(1 << 16):
                if slow and (bucket := self._bucket) is not None:
                    delay = bucket.reserve(len(data)) - bucket.clock()
                    if delay > 0:
                        time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listen.close()
        for s in self._socks:
            s.close()
