"""Network namespaces for partition tests, made on this machine by the test itself.

Every member (each node, etcd) gets a namespace of its own, joined by a veth pair to a bridge that
lives in a hub namespace. Nothing is put in the machine's own (root) namespace and no namespace
has a default route: with one end in the root namespace, a cut link would send the test's traffic
to the machine's default route, off the machine. A cut sets the bridge-side end of a member's
veth down (inside the hub); a heal sets it up again.

Inside a member's namespace the machine's host name resolves to loopback (an
`/etc/netns/<ns>/hosts` that `ip netns exec` mounts over /etc/hosts), as Debian's 127.0.1.1 line
does on a real node: stock Horovod 0.28.1 bound its process sets' Gloo device to that address
instead of HOROVOD_GLOO_IFACE, so the partition test also proves our Horovod build's fix
(scripts/build_horovod.sh).

Names carry a random tag per lab, so the leftovers of a crashed run never collide with the next;
`close()` kills what still runs in the lab's namespaces and deletes them (and their hosts files).
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from elasticyolo.local_cluster.netns import NETNS_ETC, add_namespace, delete_namespaces, ip, namespace_pids
from elasticyolo.local_cluster.netns import unavailable as unavailable  # re-exported for the partition tests

SUBNET = "10.213.0"  # private /24; members get .1, .2, ...
BRIDGE = "br0"
IFACE = "eth0"  # a member's end of its veth, in its own namespace


@dataclass(frozen=True)
class Member:
    name: str
    netns: str
    addr: str
    link: str  # the bridge-side veth end, in the hub: what a cut sets down


@dataclass
class NetLab:
    subnet: str = SUBNET
    tag: str = field(default_factory=lambda: "ey" + secrets.token_hex(3))
    members: dict[str, Member] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # namespaces created, hub first

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def start(self) -> "NetLab":
        self._add_netns(self.hub)
        self._ip(self.hub, "link", "add", BRIDGE, "type", "bridge")
        self._ip(self.hub, "link", "set", BRIDGE, "up")
        return self

    def add(self, name: str) -> Member:
        """A namespace for `name` with its address, linked to the bridge."""
        ns, link = f"{self.tag}-{name}", f"{self.tag}{name}"
        if len(link) > 15:
            raise ValueError(f"member name {name!r} too long for an interface name")
        addr = f"{self.subnet}.{len(self.members) + 1}"
        self._add_netns(ns)
        # Both ends are created straight inside their namespaces: never one in the root namespace.
        subprocess.run(["ip", "link", "add", link, "netns", self.hub, "type", "veth", "peer", "name", IFACE,
                        "netns", ns], check=True, capture_output=True, timeout=30)
        self._ip(self.hub, "link", "set", link, "master", BRIDGE, "up")
        self._ip(ns, "addr", "add", f"{addr}/24", "dev", IFACE)
        self._ip(ns, "link", "set", IFACE, "up")
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
        member = Member(name, ns, addr, link)
        self.members[name] = member
        return member

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a process inside `name`'s namespace."""
        return ["ip", "netns", "exec", self.members[name].netns]

    def run(self, name: str, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix(name), *cmd], capture_output=True, text=True, timeout=timeout)

    def cut(self, name: str) -> None:
        self._ip(self.hub, "link", "set", self.members[name].link, "down")

    def heal(self, name: str) -> None:
        self._ip(self.hub, "link", "set", self.members[name].link, "up")

    def pids(self) -> list[int]:
        """Every process running in one of the lab's namespaces."""
        return [pid for ns in self.made for pid in namespace_pids(ns)]

    def close(self) -> None:
        """Kill what still runs in the lab (all of it was started by the test) and delete it;
        members first: deleting a namespace deletes its veth ends (and their peers) with it."""
        delete_namespaces(list(reversed(self.made)))
        self.made.clear()

    def __enter__(self) -> "NetLab":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, ns: str) -> None:
        add_namespace(ns)  # loopback up: workers use it for local things
        self.made.append(ns)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        ip(ns, *args)


# A stdlib-only etcd v3 range read (JSON gateway): starts in a few tens of milliseconds.
_RANGE = """
import base64, json, sys, urllib.request
endpoint, key, end = sys.argv[1:4]
body = {"key": base64.b64encode(key.encode()).decode()}
if end:
    body["range_end"] = base64.b64encode(end.encode()).decode()
req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=json.dumps(body).encode(), method="POST")
with urllib.request.urlopen(req, timeout=5) as resp:
    kvs = json.loads(resp.read()).get("kvs") or []
print(json.dumps([[base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")).decode(),
                   int(kv["mod_revision"]), int(kv.get("lease", 0))] for kv in kvs]))
"""


class NetnsEtcdReader:
    """The reads a test makes of etcd (`get`, `get_prefix`, as `EtcdClient` has them), done from
    inside a namespace: the test process, in the root namespace, cannot reach the lab's etcd."""

    def __init__(self, lab: NetLab, member: str, endpoint: str) -> None:
        self.lab, self.member, self.endpoint = lab, member, endpoint

    def range(self, key: str, range_end: str = "") -> list[tuple[str, bytes, int, int]]:
        """[(key, value, mod_revision, lease)] sorted by key."""
        r = self.lab.run(self.member, [sys.executable, "-I", "-c", _RANGE, self.endpoint, key, range_end])
        if r.returncode != 0:
            raise RuntimeError(f"etcd read in {self.member}'s namespace failed: {r.stderr.strip()[-300:]}")
        return [(k, v.encode(), rev, lease) for k, v, rev, lease in json.loads(r.stdout)]

    def get(self, key: str) -> tuple[bytes, int] | None:
        rows = self.range(key)
        return (rows[0][1], rows[0][2]) if rows else None

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
        from elasticyolo.cluster.etcd import prefix_range_end

        end = prefix_range_end(prefix).decode()  # job prefixes are ASCII
        return [(k, v, rev) for k, v, rev, _ in self.range(prefix, end)]
