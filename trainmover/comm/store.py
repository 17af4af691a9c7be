"""The job's store (``core/kvstore.py``) as a ``torch.distributed.Store``: what gloo's and
NCCL's own rendezvous, ``PrefixStore`` and a user's script's groups are handed, so that
their keys live in the same authenticated store as the job's and nobody else can name them.

Torch calls these methods from C++ (with the GIL taken again); a timeout surfaces as
``DistStoreError`` and a lost connection as ``DistNetworkError``, as TCPStore raises them,
so torch's own retries and messages apply unchanged."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from trainmover.core import kvstore, storeaddr


class KVStore(dist.Store):
    """A client of the job's store (the built-in one or etcd: ``core/storeaddr.py``). Like
    a TCPStore client, one per thread that blocks on it (``comm.groups.StoreClients`` keeps
    one per thread)."""

    def __init__(self, address: str, run_key: bytes, timeout: timedelta,
                 connect_timeout: timedelta | None = None):
        super().__init__()
        dist.Store.set_timeout(self, timeout)    # torch's ``timeout``, read by C++ and us
        try:
            self._client = storeaddr.connect(
                address, run_key, timeout.total_seconds(),
                None if connect_timeout is None else connect_timeout.total_seconds())
        except kvstore.StoreClosed as exc:
            raise dist.DistNetworkError(str(exc)) from exc

    def set_timeout(self, timeout: timedelta) -> None:
        """torch's timeout (the base's, which its C++ side reads) and the client's waits."""
        dist.Store.set_timeout(self, timeout)
        self._client.timeout_s = timeout.total_seconds()

    def _do(self, fn, *args):
        try:
            return fn(*args)
        except kvstore.StoreNotANumber:
            raise         # the job's signed clients repair the counter (core/auth.py)
        except kvstore.StoreTimeout as exc:
            raise dist.DistStoreError(str(exc)) from exc
        except kvstore.StoreClosed as exc:
            raise dist.DistNetworkError(str(exc)) from exc
        except kvstore.StoreError as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def set(self, key: str, value) -> None:
        self._do(self._client.set, key, _bytes(value))

    def get(self, key: str, timeout: timedelta | None = None) -> bytes:
        """torch's get, waiting for the key up to the store's timeout; or up to ``timeout``
        (not torch's: ``AuthStore.await_value``)."""
        return self._do(self._client.get, key, timeout)

    def add(self, key: str, value: int) -> int:
        return self._do(self._client.add, key, value)

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._do(self._client.compare_set, key, _bytes(expected_value),
                        _bytes(desired_value))

    def try_get(self, key: str) -> bytes | None:
        """Not torch's: the value or None in one round trip (``core/auth.py`` reads with it)."""
        return self._do(self._client.try_get, key)

    def check(self, keys: list[str]) -> bool:
        return self._do(self._client.check, list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._do(self._client.wait, list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._do(self._client.delete_key, key)

    def num_keys(self) -> int:
        return self._do(self._client.num_keys)

    def append(self, key: str, value) -> None:
        self._do(self._client.append, key, _bytes(value))

    def append_then_add(self, key: str, value, counter: str, delta: int) -> int:
        """Not torch's: ``KVClient.append_then_add``."""
        return self._do(self._client.append_then_add, key, _bytes(value), counter, delta)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._do(self._client.multi_get, list(keys))

    def multi_set(self, keys: list[str], values: list) -> None:
        self._do(self._client.multi_set, list(keys), [_bytes(v) for v in values])

    def list_keys(self) -> list[str]:
        return self._do(self._client.list_keys)

    def ping(self) -> None:
        """Not torch's: one round trip that reads nothing (a host's door answers it itself
        while the connection is idle: ``core/kvproxy.py``)."""
        self._do(self._client.ping)

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        self._client.close()


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)      # torch hands values over as bytes or as lists of ints


def connect(address: str, run_key: bytes, timeout: timedelta,
            connect_timeout: timedelta | None = None) -> KVStore:
    """A client of the store at ``address`` (``HOST:PORT`` or ``etcd://...``) of the run
    ``run_key`` belongs to."""
    return KVStore(address, run_key, timeout, connect_timeout)
