"""The fault-injection suite's Mooncake cases (``test_faults_*``, each reporting its ``Tally``):
a decode process and N = 2 prefill processes over Mooncake's TCP transport on the loopback
(``mooncake_procs.py``, DRAM pools, as ``test_mooncake_cpu.py`` runs them), with faults
injected: a prefill rank killed mid-chunk, the decode killed mid-chunk, status frames
dropped, duplicated, delayed and reordered by a proxy between the ranks and the decode (a
socket pair that parses the side channel's frames, in this process), and a decode restarted
under the same ranks.

Each case asserts: nothing hangs past its deadline, no wrong byte is served (the pages of every
completed request equal the in-process reference's; failed requests are reported), nothing
leaks (every request's pages handed back, every bounce slot freed on both sides, no chunk left
in flight), then reports its tally (run with ``-s`` for the lines to show).

They need ``mooncake.engine`` (``mooncake-transfer-engine-non-cuda``): without it they say
SKIPPED, or fail when ``KVSHARD_REQUIRE_MOONCAKE`` is set (CI sets it)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvshard import mooncake

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mooncake_procs as procs  # noqa: E402
from faults import Tally  # noqa: E402
from test_mooncake_cpu import mooncake_loads  # noqa: E402

SEED = 7
#: How soon after a kill the other side must have failed what the dead process owed.
FAILED_WITHIN = 5.0
#: The prefill's transfer timeout where the decode dies.
TRANSFER_TIMEOUT = 5.0
#: The decode's deadline where statuses are dropped: far above a request's normal time on a
#: loaded 2-core machine, far below the decode's loop bound.
DROP_DEADLINE = 8.0
#: How long the proxy holds a delayed status.
DELAY = 0.5
#: How long a held (reordered) status waits for the next one before it goes anyway.
REORDER_WAIT = 0.5


class Processes:
    """The decode and prefill processes of one case, their logs and reports in ``dir``."""

    def __init__(self, dir: Path, env_extra=None):
        self.dir = dir
        self.env = dict(os.environ, GLOG_minloglevel="2", **(env_extra or {}))
        self.procs: list[subprocess.Popen] = []
        self.logs = []

    def start(self, role, *args, env=None):
        log = open(self.dir / f"{role}-{len(self.procs)}.log", "w")
        self.logs.append(log)
        p = subprocess.Popen(
            [sys.executable, str(HERE / "mooncake_procs.py"), role, str(self.dir), str(SEED), *args],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def wait(self, limit=120.0):
        end = time.monotonic() + limit
        try:
            for p in self.procs:
                p.wait(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in self.logs:
                log.close()

    def wait_for(self, name, limit=60.0):
        end = time.monotonic() + limit
        while not (self.dir / f"{name}.json").exists():
            assert time.monotonic() < end, f"no {name} report within {limit} s"
            time.sleep(0.01)

    def read(self, name):
        f = self.dir / f"{name}.json"
        if not f.exists():
            text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.dir.glob("*.log"))
            pytest.fail(f"{name} wrote no report; logs:\n{text}")
        return json.loads(f.read_text())


def served_wrong(decode) -> int:
    """Pages of completed requests that differ from the reference."""
    return sum(r.get("wrong_pages", 0) for r in decode["results"].values() if r["completed"])


def nothing_leaked(decode, prefills) -> bool:
    """Every request handed back with its pages, no slot held on either side, nothing in
    flight."""
    reqs = {reg.request: reg for reg, _, _ in procs.requests(SEED)}
    back = sorted(decode["results"]) == sorted(str(r) for r in reqs) and decode["pending"] == 0
    pages = all(
        r["pages_back"] == len(reqs[int(k)].pages) + len(reqs[int(k)].state_pages) for k, r in decode["results"].items()
    )
    slots = decode["busy_slots"] == [0] * procs.N
    freed = all(p["slots_free"] == p["slots"] and p["in_flight"] == 0 for p in prefills)
    return back and pages and slots and freed


def test_faults_mooncake_prefill_killed_mid_chunk(tmp_path):
    mooncake_loads()
    ps = Processes(tmp_path)
    ps.start("decode")
    ps.start("prefill", "0")
    ps.start("prefill-die", "1")
    ps.wait()
    decode = ps.read("decode-0")
    killed = ps.read("killed-1")["at"]
    failed = {int(k): r for k, r in decode["results"].items() if not r["completed"]}
    tally = Tally()
    tally.served_wrong = served_wrong(decode)
    tally.fault(
        procs.DIES_IN in failed
        and all({f[0] for f in r["failures"]} == {1} and r["at"] - killed < FAILED_WITHIN for r in failed.values())
        and decode["overdue"] == []
        and nothing_leaked(decode, [ps.read("prefill-0-closed")])
    )
    tally.report("mooncake: a prefill rank killed mid-chunk")


def test_faults_mooncake_decode_killed_mid_chunk(tmp_path):
    mooncake_loads()
    ps = Processes(tmp_path, {"KVSHARD_MC_TIMEOUT": str(TRANSFER_TIMEOUT), "KVSHARD_MC_PACE": "0.2"})
    ps.start("decode-die")
    ps.start("prefill", "0")
    ps.start("prefill", "1")
    ps.wait()
    killed = ps.read("killed-0")["at"]
    tally = Tally()
    survived = True
    failures = 0
    for rank in range(procs.N):
        pre = ps.read(f"prefill-{rank}")
        closed = ps.read(f"prefill-{rank}-closed")
        failures += pre["statuses"].count(False) + len(pre["errors"])
        survived &= bool(pre["gone"]) and pre["at"] - killed < TRANSFER_TIMEOUT + FAILED_WITHIN
        survived &= closed["slots_free"] == closed["slots"] and closed["in_flight"] == 0
    tally.fault(survived and failures > 0)
    tally.report("mooncake: the decode killed mid-chunk")


class Proxy:
    """Between the prefill ranks and the decode: forwards the side channel both ways, and does
    ``faults[rank][i]`` (``drop``, ``dup``, ``delay``, ``swap`` with the next) to rank
    ``rank``'s ``i``-th status frame on its way to the decode. ``hits`` records each fault done
    as (rank, kind, request, chunk)."""

    def __init__(self, dir: Path, faults):
        self.dir = dir
        self.faults = faults
        self.hits = []
        self.server = socket.create_server(("127.0.0.1", 0))
        tmp = dir / "proxy.addr.tmp"
        tmp.write_text(json.dumps(list(self.server.getsockname()[:2])))
        tmp.rename(dir / "proxy.addr")
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _serve(self, down):
        addr = self.dir / "decode.addr"
        while not addr.exists():
            time.sleep(0.01)
        up = socket.create_connection(tuple(json.loads(addr.read_text())))
        threading.Thread(target=self._pump, args=(up, down), daemon=True).start()
        self._pump_statuses(down, up)

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _pump_statuses(self, src, dst):
        reader = mooncake.SideReader()
        rank, index, held = None, 0, None
        src.settimeout(REORDER_WAIT)
        try:
            while True:
                try:
                    data = src.recv(1 << 16)
                except (TimeoutError, socket.timeout):
                    if held is not None:
                        dst.sendall(held)
                        held = None
                    continue
                if not data:
                    break
                for f in reader.feed(data):
                    out = mooncake.side_frame(f)
                    if f["t"] == "hi":
                        rank = f["rank"]
                    kind = self.faults.get(rank, {}).get(index) if f["t"] == "status" else None
                    index += f["t"] == "status"
                    if kind is not None:
                        self.hits.append((rank, kind, f["status"].request, f["status"].chunk))
                    if kind == "drop":
                        continue
                    if kind == "swap":
                        held = out
                        continue
                    if kind == "delay":
                        time.sleep(DELAY)
                    dst.sendall(out + out if kind == "dup" else out)
                    if held is not None:
                        dst.sendall(held)
                        held = None
        except OSError:
            pass
        if held is not None:
            try:
                dst.sendall(held)
            except OSError:
                pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.server.close()


def test_faults_mooncake_status_frames_dropped_duplicated_delayed_reordered(tmp_path):
    mooncake_loads()
    faults = {0: {6: "drop", 1: "dup"}, 1: {1: "dup", 3: "delay", 5: "swap"}}
    proxy = Proxy(tmp_path, faults)
    ps = Processes(tmp_path, {"KVSHARD_MC_DEADLINE": str(DROP_DEADLINE)})
    ps.start("decode")
    for rank in range(procs.N):
        ps.start("prefill", str(rank), env={"KVSHARD_MC_CONNECT": "proxy.addr"})
    ps.wait()
    proxy.close()
    decode = ps.read("decode-0")
    results = {int(k): r for k, r in decode["results"].items()}
    closed = [ps.read(f"prefill-{rank}-closed") for rank in range(procs.N)]
    assert len(proxy.hits) == sum(len(f) for f in faults.values()), proxy.hits
    dropped = {request for _, kind, request, _ in proxy.hits if kind == "drop"}
    leaked = not nothing_leaked(decode, closed)
    tally = Tally()
    tally.served_wrong = served_wrong(decode)
    for rank, kind, request, chunk in proxy.hits:
        r = results.get(request)
        if r is None or leaked:
            tally.fault(False)
        elif kind == "drop":
            # Overdue at its deadline, the rank told to abort it, handed back failed.
            tally.fault(not r["completed"] and request in decode["overdue"])
        else:
            tally.fault(r["completed"] or request in dropped)
    assert decode["counters"]["dropped_statuses"] >= 2, decode["counters"]
    tally.report("mooncake: status frames dropped, duplicated, delayed, reordered")


def test_faults_mooncake_decode_restarted_under_the_same_ranks(tmp_path):
    mooncake_loads()
    ps = Processes(tmp_path, {"KVSHARD_MC_TIMEOUT": str(TRANSFER_TIMEOUT), "KVSHARD_MC_PACE": "0.2"})
    ps.start("decode-die")
    ps.start("prefill-reconnect", "0")
    ps.start("prefill-reconnect", "1")
    ps.wait_for("killed-0")
    ps.start("decode", env={"KVSHARD_MC_SESSION": "2"})
    ps.wait()
    decode = ps.read("decode2-0")
    prefills = [ps.read(f"prefill2-{rank}") for rank in range(procs.N)]
    tally = Tally()
    tally.served_wrong = served_wrong(decode)
    tally.fault(
        decode["identical"]
        and all(r["completed"] for r in decode["results"].values())
        and all(p["errors"] == [] and len(p["statuses"]) == 9 and all(p["statuses"]) for p in prefills)
        and nothing_leaked(decode, [ps.read(f"prefill2-{rank}-closed") for rank in range(procs.N)])
    )
    tally.report("mooncake: a decode restarted under the same ranks")
