"""An emulated multi-node cluster on one Linux machine, for tests and benchmarks.

    sudo python -m amsp_planner.emulate --nodes 2 --nproc 4 --rate-mbit 800 -- \\
        -m amsp_planner.cli.main calibrate --out /tmp/emu.yaml

Each "node" is a network namespace ``amsp-<pid>-n<i>`` with its own loopback (the in-node
fabric: ranks of one node talk over it) and one uplink veth ``amsp0``. Two nodes are joined by
one veth pair; more nodes hang off a bridge in a namespace ``amsp-<pid>-br``. Addresses come from
a private /24 (10.213.<k>.0/24 by default) assigned only on those veths, and gloo is told to use
``amsp0``, so every cross-node byte goes over a link this module made and nothing else. Each
uplink direction gets a token-bucket qdisc (``tc ... tbf``) at the node's bandwidth, plus a
``netem`` delay where the kernel has netem (``EmulatedCluster.notes`` says when it has not).

One torchrun agent runs per node (``ip netns exec``), node 0 hosting the rendezvous. The uplinks'
kernel byte counters (/sys/class/net/amsp0/statistics/{tx,rx}_bytes, read inside each namespace)
say what really crossed nodes, next to the runtime's logical (ring-convention) bytes. Processes
inside a node can read their own node's counters with ``read_link_bytes()``.

Everything is torn down on exit from the context manager: on success, on exceptions, and on
SIGTERM/SIGHUP (turned into SystemExit while the cluster is up); namespaces of dead owners are
removed on the next start. Needs root (CAP_NET_ADMIN) and iproute2; ``EmulationUnavailable``
says why when it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

PREFIX = "amsp-"
LINK = "amsp0"
"""The uplink device of every node namespace."""
MASTER_PORT = 29500


class EmulationUnavailable(RuntimeError):
    """The machine cannot host the emulated cluster (no root, no iproute2, no tbf...)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise EmulationUnavailable("iproute2 'ip' is not installed") from None
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True,
                          text=True, timeout=30)


def probe() -> str | None:
    """None when namespaces, veths and tbf work here; else the reason they do not."""
    ns = f"{PREFIX}{os.getpid()}-probe"
    try:
        res = _ip("netns", "add", ns, check=False)
    except EmulationUnavailable as e:
        return str(e)
    if res.returncode:
        return f"'ip netns add' is not permitted here ({res.stderr.strip() or 'no permission'})"
    try:
        res = _ip("-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "a1", check=False)
        if res.returncode:
            return f"cannot create veth pairs ({res.stderr.strip()})"
        tc = _tc(ns, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "100mbit", "burst",
                 "64kb", "latency", "100ms")
        if tc.returncode:
            return f"tc tbf is not available ({tc.stderr.strip()})"
        return None
    finally:
        _ip("netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete amsp-<pid>-* namespaces whose owning process is gone; returns their names."""
    out = []
    for name in _netns_names():
        parts = name[len(PREFIX):].split("-")
        if not parts[0].isdigit():
            continue
        pid = int(parts[0])
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            _ip("netns", "del", name, check=False)
            out.append(name)
    return out


def _netns_names() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines()
            if line.strip().startswith(PREFIX)]


def read_link_bytes(dev: str | None = None) -> dict[str, int]:
    """{'tx': bytes, 'rx': bytes} of this namespace's uplink (from inside a node)."""
    dev = dev or os.environ.get("AMSP_EMU_LINK", LINK)
    base = f"/sys/class/net/{dev}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return {"tx": int(tx.read()), "rx": int(rx.read())}


@dataclass
class EmulatedCluster:
    """A live emulated cluster (see the module docstring); make it with ``emulated_cluster``."""

    nodes: int
    rate_mbit: float
    delay_ms: float
    subnet: int
    namespaces: list[str] = field(default_factory=list)
    """Node namespaces, in node order."""
    bridge: str | None = None
    addrs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def master_addr(self) -> str:
        return self.addrs[0]

    # ----- running things in the nodes --------------------------------------------------
    def node_env(self, node: int, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        env.update(GLOO_SOCKET_IFNAME=LINK, MASTER_ADDR=self.master_addr, AMSP_EMU_LINK=LINK,
                   AMSP_EMU_NODE=str(node), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        env.pop("NCCL_SOCKET_IFNAME", None)
        env.update(extra or {})
        return env

    def popen(self, node: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start `argv` inside node `node`'s namespace (its own session, killed at teardown)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv],
                             env=self.node_env(node, env), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def torchrun(self, nproc: int, args: list[str], env: dict | None = None,
                 port: int = MASTER_PORT, **kw) -> list[subprocess.Popen]:
        """One torchrun agent per node running `python -m torch.distributed.run ... args`
        (args: a script and its arguments, or '-m', module, ...)."""
        from amsp_planner.runtime.launch import torchrun_cmd

        return [self.popen(node, torchrun_cmd(nproc, port, self.nodes, node, self.master_addr)
                           + list(args), env, **kw) for node in range(self.nodes)]

    def run_torchrun(self, nproc: int, args: list[str], env: dict | None = None,
                     timeout: float = 600, port: int = MASTER_PORT) -> list[tuple[int, str, str]]:
        """`torchrun` on every node, waiting for all: [(returncode, stdout, stderr)] by node."""
        procs = self.torchrun(nproc, args, env, port, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        out = []
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out.append((p.returncode, so, se))
        finally:
            for p in procs:
                _kill(p)
        return out

    # ----- the links --------------------------------------------------------------------
    def link_counters(self) -> list[dict[str, int]]:
        """[{'tx', 'rx'}] bytes of each node's uplink, read from its namespace's sysfs."""
        out = []
        for ns in self.namespaces:
            res = subprocess.run(
                ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{LINK}/statistics/tx_bytes",
                 f"/sys/class/net/{LINK}/statistics/rx_bytes"],
                capture_output=True, text=True, timeout=30, check=True)
            tx, rx = (int(v) for v in res.stdout.split())
            out.append({"tx": tx, "rx": rx})
        return out

    # ----- life cycle -------------------------------------------------------------------
    def _up(self) -> None:
        pid = os.getpid()
        self.addrs = [f"10.213.{self.subnet}.{i + 1}" for i in range(self.nodes)]
        for i in range(self.nodes):
            ns = f"{PREFIX}{pid}-n{i}"
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if self.nodes == 2:  # point to point
            a, b = self.namespaces
            _ip("-n", a, "link", "add", LINK, "type", "veth", "peer", "name", LINK, "netns", b)
            ends = [(a, LINK), (b, LINK)]
        else:
            self.bridge = f"{PREFIX}{pid}-br"
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            ends = []
            for i, ns in enumerate(self.namespaces):
                port = f"n{i}"
                _ip("-n", ns, "link", "add", LINK, "type", "veth", "peer", "name", port,
                    "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                ends += [(ns, LINK), (self.bridge, port)]
        for i, ns in enumerate(self.namespaces):
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", LINK)
            _ip("-n", ns, "link", "set", LINK, "up")
        for ns, dev in ends:
            self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        """Rate (tbf) and, where the kernel has netem, delay on the egress of `dev`."""
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(128 * 1024, int(rate_bytes / 250))  # >= a 64 KiB GSO segment, ~4 ms
        res = _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
                  f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms")
        if res.returncode:
            raise RuntimeError(f"tc tbf on {dev} in {ns}: {res.stderr.strip()}")
        if self.delay_ms > 0:
            res = _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                      "delay", f"{self.delay_ms}ms")
            if res.returncode and f"netem: {res.stderr.strip()}" not in self.notes:
                self.notes.append(f"netem: {res.stderr.strip()} (links carry no added delay)")

    def close(self) -> None:
        for p in self.procs:
            _kill(p)
        self.procs.clear()
        names = list(self.namespaces) + ([self.bridge] if self.bridge else [])
        for ns in names:
            _ip("netns", "del", ns, check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and set(names) & set(_netns_names()):
            time.sleep(0.05)
        self.namespaces, self.bridge = [], None


def _kill(p: subprocess.Popen) -> None:
    """Terminate `p`'s whole session (torchrun and its workers), then kill what is left."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)  # workers left in the session
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=5)


@contextlib.contextmanager
def emulated_cluster(nodes: int = 2, rate_mbit: float = 1000.0, delay_ms: float = 0.0,
                     subnet: int | None = None) -> Iterator[EmulatedCluster]:
    """Bring up `nodes` emulated nodes whose uplinks carry `rate_mbit` Mbit/s each way (plus
    `delay_ms` where netem exists); always torn down on exit."""
    if nodes < 2 or nodes > 200:
        raise ValueError(f"nodes: {nodes} is out of range: use 2 to 200")
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit: {rate_mbit} must be positive")
    reason = probe()
    if reason:
        raise EmulationUnavailable(reason)
    cleanup_stale()
    cluster = EmulatedCluster(nodes, rate_mbit, delay_ms,
                              os.getpid() % 250 if subnet is None else subnet)
    restore = _trap_signals()
    try:
        cluster._up()
        yield cluster
    finally:
        cluster.close()
        restore()


def _trap_signals():
    """Turn SIGTERM/SIGHUP into SystemExit (so the teardown runs); returns the undo."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {}

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)

    def restore():
        for sig, h in old.items():
            signal.signal(sig, h)

    return restore


def main(argv: list[str] | None = None) -> int:
    """Run a torchrun job on an emulated cluster: the arguments after '--' go to torchrun."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m amsp_planner.emulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4, help="ranks per node")
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="uplink Mbit/s per direction")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    try:
        with emulated_cluster(a.nodes, a.rate_mbit, a.delay_ms) as emu:
            for note in emu.notes:
                print(f"note: {note}", file=sys.stderr)
            before = emu.link_counters()
            procs = emu.torchrun(a.nproc, rest)
            codes = [p.wait() for p in procs]
            after = emu.link_counters()
    except EmulationUnavailable as e:
        print(f"error: emulated cluster unavailable: {e}", file=sys.stderr)
        return 2
    for i, (b, c) in enumerate(zip(before, after, strict=True)):
        print(f"node {i}: uplink tx {c['tx'] - b['tx']:,} B, rx {c['rx'] - b['rx']:,} B",
              file=sys.stderr)
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
