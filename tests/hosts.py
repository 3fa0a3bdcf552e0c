"""Hosts on one machine, for faults between them: each host is a network namespace on a bridge,
with its own address, its own hostname (a UTS namespace for every process started in it), its own
temp and staging directories; they share the filesystem (the venv, the data) and nothing else.

Faults, as a cluster meets them:
  kill()        every process of the host, at once (node loss)
  cut(addr)     one address unreachable from this host, until uncut(addr): S3 cut off from one
                node; two hosts cut from each other (a network partition, then heal)

Needs root (`ip netns`, veth pairs, a bridge); `available()` says whether this machine lets us.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces, veth pairs and bridges work here; else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"vxp{uuid.uuid4().hex[:6]}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


class Host:
    def __init__(self, net: "Net", name: str, index: int):
        self.net, self.name = net, name
        self.ns = f"{net.tag}-{name}"
        self.addr = f"10.{net.octet}.0.{index + 2}"
        self.veth = f"{net.tag}{index}"  # the root side, on the bridge: its link is the host's cable
        self.root = net.root / name
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.etc = Path("/etc/netns") / self.ns
        ip("netns", "add", self.ns)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        ip("link", "set", self.veth, "master", net.bridge, "up")
        ip("-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", "eth0")
        ip("-n", self.ns, "link", "set", "eth0", "up")
        ip("-n", self.ns, "link", "set", "lo", "up")

    def env(self, extra: dict | None = None) -> dict:
        """The environment of a process on this host: its own temp dir (Ray's and vx's task files)
        and its own cache (vx's staging); a VX_CACHE_DIR of this process's is not carried."""
        env = {k: v for k, v in os.environ.items() if k != "VX_CACHE_DIR"}
        return dict(env, TMPDIR=str(self.tmp), XDG_CACHE_HOME=str(self.root / "cache"), **(extra or {}))

    def command(self, cmd: list[str]) -> list[str]:
        """cmd run in this host's network namespace under its own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *map(str, cmd)]

    def popen(self, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(cmd), env=self.env(env), **kw)

    def run(self, cmd: list[str], env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def pids(self) -> list[int]:
        return [int(p) for p in ip("netns", "pids", self.ns, check=False).stdout.split()]

    def kill(self) -> int:
        """Every process of the host, SIGKILLed together (as a node's power goes); how many."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def cut(self, addr: str) -> None:
        """addr unreachable from this host (its packets get an ICMP-style refusal at once)."""
        ip("-n", self.ns, "route", "add", "unreachable", f"{addr}/32")

    def uncut(self, addr: str) -> None:
        ip("-n", self.ns, "route", "del", "unreachable", f"{addr}/32", check=False)

    def close(self) -> None:
        self.kill()
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        ip("link", "del", self.veth, check=False)
        ip("netns", "del", self.ns, check=False)
        shutil.rmtree(self.etc, ignore_errors=True)


class Net:
    """Hosts on one bridge: Net(root, ["s3", "a", "b"]).hosts["a"]."""

    def __init__(self, root: Path, names: list[str]):
        self.tag = f"vx{uuid.uuid4().hex[:5]}"
        self.octet = 100 + int(self.tag[2:], 16) % 100  # 10.1xx.0.0/24, its own per harness
        self.root, self.bridge, self.hosts = Path(root), f"{self.tag}br", {}
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"10.{self.octet}.0.1/24", "dev", self.bridge)  # this process reaches every host
        ip("link", "set", self.bridge, "up")
        try:
            for i, name in enumerate(names):
                self.hosts[name] = Host(self, name, i)
            # each host resolves every host's name (`ip netns exec` mounts /etc/netns/NS/hosts on /etc/hosts)
            table = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts.values())
            for h in self.hosts.values():
                h.etc.mkdir(parents=True, exist_ok=True)
                (h.etc / "hosts").write_text(table)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        for h in self.hosts.values():
            h.close()
        ip("link", "del", self.bridge, check=False)
