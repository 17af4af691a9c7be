"""Several "hosts" on one machine: network namespaces joined to the root namespace by a bridge,
each with its own address (needs root and iproute2; tests skip without them).

The root namespace is host 0 (the bridge's address); ``Hosts.run(i, argv)`` starts a process
inside host i's namespace; ``down(i)`` / ``up(i)`` cut and restore host i's link."""
from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tmp{os.getpid() % 100000}"
    try:
        for args in (("netns", "add", probe), ("link", "add", probe + "b", "type", "bridge"),
                     ("link", "add", probe + "v", "type", "veth", "peer", "name", "eth0",
                      "netns", probe)):
            got = _ip(*args, check=False)
            if got.returncode != 0:
                return f"'ip {' '.join(args)}' failed: {got.stderr.strip()}"
        return None
    finally:   # what the probe made, the veth pair included (deleting the namespace)
        _ip("link", "del", probe + "b", check=False)
        _ip("netns", "del", probe, check=False)


_made_count = 0


class Hosts:
    def __init__(self, count: int):
        """``count`` hosts: host 0 is the root namespace, 1..count-1 are new namespaces."""
        global _made_count
        _made_count += 1
        # names unique per process and instance (a namespace lingers while processes that
        # were inside it finish dying)
        tag = (os.getpid() * 7 + _made_count) % 10000
        self.subnet = 100 + tag % 100              # 10.<subnet>.<tag//100>.0/24, per run
        self.bridge = f"tmbr{tag}"
        self.names = [None] + [f"tm{tag}h{i}" for i in range(1, count)]
        self.veths = [None] + [f"tm{tag}v{i}" for i in range(1, count)]
        self._base = f"10.{self.subnet}.{tag // 100}"
        self.addresses = [f"{self._base}.1"] + [f"{self._base}.{10 + i}"
                                                 for i in range(1, count)]
        self._made: list[tuple[str, ...]] = []

    def __enter__(self) -> "Hosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.addresses[0]}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(1, len(self.names)):
                ns, veth = self.names[i], self.veths[i]
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for args in reversed(self._made):
            _ip(*args, check=False)
        self._made = []

    def command(self, host: int, argv: list[str]) -> list[str]:
        return list(argv) if host == 0 else ["ip", "netns", "exec", self.names[host], *argv]

    def run(self, host: int, argv: list[str], **popen) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **popen)

    def down(self, host: int) -> None:
        _ip("link", "set", self.veths[host], "down")

    def up(self, host: int) -> None:
        _ip("link", "set", self.veths[host], "up")
