"""Names, paths and addresses every part of a run agrees on (the origin's name, its files, the namespaces' ports)."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = BENCH_DIR / "results"

ORIGIN_NAME = "origin.bench"
DENIED_NAME = "denied.bench"
SMALL_PATH = "/small.txt"
BIG_PATH = "/big.bin"
SMALL_BODY = b"hello from origin.bench: a small static body for keep-alive and new-connection rounds.\n" * 2
# transparent mode: addresses and ports inside the namespaces this run creates (nothing else is there)
TRANSPARENT_ORIGIN_IP = "93.184.216.34"  # on lo of the run's own "internet" namespace only
TRANSPARENT_PORTS = {"mitmdump": 18091, "gateway": 18092}  # listeners in the run's gateway namespace
TRANSPARENT_DNS_PORTS = {"mitmdump": 15391, "gateway": 15392}  # nothing listens: names come from hosts files
TRANSPARENT_SANDBOX_INDEX = {"mitmdump": 1, "gateway": 2}  # sandbox 10.203.K.2 -> gateway side 10.203.K.1
IDLE_SOURCES = "127.0.0.201,127.0.0.202,127.0.0.203,127.0.0.204"  # the idle client spreads over these
