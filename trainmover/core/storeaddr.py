"""Where the job's store is, as one string every process can be handed, and a client of it.

Two kinds:

- ``HOST:PORT``: the built-in store (``core/kvserver.py``), served by host 0's agent;
- ``etcd://HOST:PORT,HOST:PORT,...?ca=FILE&cert=FILE&key=FILE``: an etcd cluster
  (``core/etcdstore.py``), reached over mutual TLS with the job's client certificate; the
  store outlives any one host.

The string names files, never their contents, so it may appear on command lines."""
from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from trainmover.core import etcdstore, kvstore

ETCD_SCHEME = "etcd://"


@dataclass(frozen=True)
class EtcdAddress:
    endpoints: tuple[tuple[str, int], ...]
    tls: etcdstore.EtcdTLS

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return (f"{ETCD_SCHEME}{hosts}?ca={self.tls.ca}&cert={self.tls.cert}"
                f"&key={self.tls.key}")


def is_etcd(address: str) -> bool:
    return address.startswith(ETCD_SCHEME)


def parse_etcd(address: str, check_files: bool = True) -> EtcdAddress:
    """An ``etcd://`` address; a ``ValueError`` naming what is wrong with it."""
    if not is_etcd(address):
        raise ValueError(f"an etcd store's address starts with {ETCD_SCHEME!r}: {address!r}")
    parts = urlsplit(address)
    endpoints = []
    for item in parts.netloc.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r} in {address!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"ca", "cert", "key"})
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the etcd address "
                         f"{address!r} (it takes ca, cert and key)")
    files = {}
    for name in ("ca", "cert", "key"):
        values = query.get(name, [])
        if len(values) != 1 or not values[0]:
            raise ValueError(f"the etcd address {address!r} needs {name}=FILE once: the "
                             f"store is reached over mutual TLS only (see docs/failures.md)")
        if check_files and not os.path.isfile(values[0]):
            raise ValueError(f"{name}={values[0]!r} in the etcd address is not a file")
        files[name] = values[0]
    if check_files and os.stat(files["key"]).st_mode & 0o077:
        raise ValueError(f"key={files['key']!r}: the job's etcd client key is readable by "
                         f"other users (mode {oct(os.stat(files['key']).st_mode & 0o777)}): "
                         f"chmod 600 it, as whoever holds it can write the job's store")
    return EtcdAddress(tuple(endpoints), etcdstore.EtcdTLS(**files))


def connect(address: str, run_key: bytes, timeout_s: float,
            connect_timeout_s: float | None = None):
    """A client of the store at ``address`` for the run ``run_key`` belongs to: a
    ``KVClient`` or an ``EtcdClient``, with the same methods."""
    if is_etcd(address):
        etcd = parse_etcd(address, check_files=False)
        return etcdstore.EtcdClient(list(etcd.endpoints), kvstore.store_key(run_key), timeout_s,
                                    etcd.tls, connect_timeout_s=connect_timeout_s)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT or {ETCD_SCHEME}..., got "
                         f"{address!r}")
    return kvstore.connect(host, int(port), run_key, timeout_s, connect_timeout_s)
