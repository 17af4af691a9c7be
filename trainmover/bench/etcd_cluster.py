"""A throw-away etcd cluster for tests and benchmarks: members on loopback (or given
addresses), mutual TLS between clients and members and between members, data on tmpfs,
each member a child process this helper stops by PID. Needs Debian's ``etcd-server`` and
``openssl``. Not for production: its certificates live two days and its members are
tuned for one machine (50 ms heartbeats, 500 ms elections)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from trainmover.core.etcdstore import EtcdTLS

ETCD = shutil.which("etcd")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_certs(folder: Path, ips: list[str]) -> tuple[EtcdTLS, Path, Path]:
    """A CA, a member certificate for ``ips`` (server and peer use) and a client one."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    sans = ",".join(f"IP:{ip}" for ip in ips)
    for name, usage in (("member", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (folder / f"{name}.ext").write_text(
            f"subjectAltName={sans}\nextendedKeyUsage={usage}\n")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    for f in folder.iterdir():
        f.chmod(0o600)
    return (EtcdTLS(str(folder / "ca.pem"), str(folder / "client.pem"),
                    str(folder / "client.key")),
            folder / "member.pem", folder / "member.key")


class EtcdCluster:
    def __init__(self, folder: Path, members: int = 3, ips: list[str] | None = None,
                 wrap=lambda i, argv: argv):
        """``wrap(i, argv)``: the command that runs member i's ``argv`` (in a namespace)."""
        self.folder, self.wrap = folder, wrap
        self.ips = ips or ["127.0.0.1"] * members
        self.tls, self._cert, self._key = make_certs(folder / "certs",
                                                     sorted(set(self.ips) | {"127.0.0.1"}))
        # ports free here are free in a namespace of their own too
        self.client_ports = [_free_port() for _ in self.ips]
        self.peer_ports = [_free_port() for _ in self.ips]
        self.data = Path("/dev/shm") / f"etcd-test-{os.getpid()}-{id(self)}"
        self.procs: list[subprocess.Popen | None] = [None] * len(self.ips)

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return list(zip(self.ips, self.client_ports))

    def address(self) -> str:
        """The job's ``etcd://`` store address for this cluster."""
        t = self.tls
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}?ca={t.ca}&cert={t.cert}&key={t.key}"

    def _peer(self, i: int) -> str:
        return f"https://{self.ips[i]}:{self.peer_ports[i]}"

    def command(self, i: int, state: str = "new") -> list[str]:
        ca = self.tls.ca
        return [ETCD, "--name", f"m{i}", "--data-dir", str(self.data / f"m{i}"),
                "--listen-client-urls", f"https://{self.ips[i]}:{self.client_ports[i]}",
                "--advertise-client-urls", f"https://{self.ips[i]}:{self.client_ports[i]}",
                "--listen-peer-urls", self._peer(i),
                "--initial-advertise-peer-urls", self._peer(i),
                "--initial-cluster", ",".join(f"m{j}={self._peer(j)}"
                                              for j in range(len(self.ips))),
                "--initial-cluster-state", state, "--initial-cluster-token", "trainmover-test",
                "--client-cert-auth", "--trusted-ca-file", ca, "--cert-file", str(self._cert),
                "--key-file", str(self._key),
                "--peer-client-cert-auth", "--peer-trusted-ca-file", ca,
                "--peer-cert-file", str(self._cert), "--peer-key-file", str(self._key),
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--log-level", "error"]

    def start(self, timeout_s: float = 30.0) -> "EtcdCluster":
        for i in range(len(self.ips)):
            self.start_member(i)
        deadline = time.monotonic() + timeout_s
        while self.leader() is None:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test etcd cluster elected no leader")
            time.sleep(0.1)
        return self

    def start_member(self, i: int) -> None:
        log = open(self.folder / f"m{i}.log", "ab")
        self.procs[i] = subprocess.Popen(self.wrap(i, self.command(i)), stdout=log, stderr=log,
                                         start_new_session=True)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs[i] = None

    def status(self, i: int) -> dict | None:
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        req = urllib.request.Request(
            f"https://{self.ips[i]}:{self.client_ports[i]}/v3/maintenance/status",
            data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def leader(self) -> int | None:
        """The index of the member that leads (None: none known)."""
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            st = self.status(i)
            if st and st.get("leader") and st.get("leader") == st.get("header", {}).get(
                    "member_id"):
                return i
        return None

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.data, ignore_errors=True)
