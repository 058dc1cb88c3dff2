#!/usr/bin/env python3
"""Kills `pageone daemon` under four merged clients, starts another, and measures the clients'
return: when all joined it, when every page is merged onto its store again, the engines' CPU,
and the store memory (Shmem) before, at the peak and after (the dead daemon's store is freed once
no page maps it). Then every client checks its data.

    cargo build --release -p pageone
    python3 scripts/bench-rejoin.py [MIB per client, default 512] [--period-ms N]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "pageone")
parser = argparse.ArgumentParser(description="pageone clients joining a restarted daemon")
parser.add_argument("mib", nargs="?", type=int, default=512, help="MiB per client (default 512)")
parser.add_argument("--period-ms", default="100", help="the clients' merge period (default 100)")
opts = parser.parse_args()
MIB = opts.mib
PERIOD = opts.period_ms
SOCK = os.path.join(tempfile.mkdtemp(), "rejoin.sock")
PAGES = MIB * 256


def shmem_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) // 1024


def start_daemon():
    d = subprocess.Popen([BIN, "daemon", "--socket", SOCK], stderr=subprocess.DEVNULL)
    while not os.path.exists(SOCK):
        time.sleep(0.01)
    time.sleep(0.1)
    return d


def ask(c, cmd):
    c.stdin.write(cmd + "\n")
    c.stdin.flush()
    return c.stdout.readline()


def stats(c):
    return json.loads(ask(c, "STATS"))


daemon = start_daemon()
env = dict(os.environ, PAGEONE_SOCKET=SOCK, PAGEONE_SCOPE="rejoin")
clients = [
    subprocess.Popen(
        [BIN, "scope-client", "--mib", str(MIB), "--period-ms", PERIOD, "--workers", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    for _ in range(4)
]
for c in clients:
    c.stdout.readline()  # READY
while not all(stats(c)["pages_shared"] == PAGES for c in clients):
    time.sleep(0.05)
print(f"4 clients x {MIB} MiB merged; Shmem {shmem_mib()} MiB")
daemon.kill()
daemon.wait()
os.unlink(SOCK)
for c in clients:
    ask(c, "KICK")
print("daemon killed; clients:", [stats(c)["daemon"] for c in clients])
cpu0 = sum(stats(c)["worker_cpu_ns"] for c in clients)
t0 = time.time()
daemon = start_daemon()
joined = None
peak = 0
while True:
    st = [stats(c) for c in clients]
    peak = max(peak, shmem_mib())
    if joined is None and all(s["daemon_joins"] == 1 for s in st):
        joined = time.time() - t0
    if joined is not None and all(s["pages_shared"] == PAGES for s in st):
        break
    time.sleep(0.02)
back = time.time() - t0
cpu = (sum(s["worker_cpu_ns"] for s in st) - cpu0) / 1e9
print(f"all joined the new daemon {joined:.2f} s after it started; every page merged onto its "
      f"store at {back:.2f} s; engines' CPU {cpu:.2f} s")
while shmem_mib() > MIB + 16 and time.time() - t0 < 30:
    time.sleep(0.1)
print(f"Shmem peak {peak} MiB during the move, {shmem_mib()} MiB at {time.time() - t0:.2f} s; "
      f"pages made private: {[stats(c)['pages_left_private'] for c in clients]}")
results = [ask(c, "VERIFY").strip() for c in clients]
print("data:", results)
for c in clients:
    c.stdin.close()
    c.wait()
daemon.kill()
sys.exit(0 if all(r == "OK" for r in results) else 1)
