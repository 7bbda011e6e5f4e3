"""The streaming group's summary, targets and markdown section (bench/report.py adds them to the report)."""

from __future__ import annotations

import statistics

from lib.sse_events import KINDS, LATENCY_KEYS, label

MEDIAN_TARGET_MS = 5.0
WORST_TARGET_MS = 50.0
MEMORY_TARGET_KIB = 100.0


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarise_latency(result: dict) -> None:
    lat = result["latency"]
    for key, entry in lat.items():
        kind, proto = key.rsplit("_", 1)
        rounds = entry["rounds"]
        samples = sorted(s for r in rounds for s in r["samples_ms"])
        statuses = [r["status"] for r in rounds]
        summary = {"events": len(samples), "rounds": len(rounds), "p50_ms": _pct(samples, 50),
                   "p99_ms": _pct(samples, 99), "max_ms": samples[-1] if samples else None,
                   "status": "ok" if statuses and all(s == "ok" for s in statuses) else
                   next((s for s in statuses if s != "ok"), "not run"),
                   "origin_protocol": next((r.get("origin_protocol") for r in rounds if r.get("origin_protocol")), None),
                   "origin_auth": next((r.get("origin_auth") for r in rounds if r.get("origin_auth")), None),
                   "headers_arrived": next((r.get("headers_arrived") for r in rounds if "headers_arrived" in r), None),
                   "error": next((r["error"] for r in rounds if r.get("error")), None)}
        if kind != "direct":
            direct = {r["round"]: r for r in lat.get(f"direct_{proto}", {}).get("rounds", [])}
            extra, paired = [], []
            for r in rounds:
                base = direct.get(r["round"])
                if not r["samples_ms"] or not base or not base["samples_ms"]:
                    continue
                b = statistics.median(base["samples_ms"])
                extra += [s - b for s in r["samples_ms"]]
                paired.append(statistics.median(r["samples_ms"]) - b)
            extra.sort()
            summary.update({"extra_median_ms": _pct(extra, 50), "extra_p99_ms": _pct(extra, 99),
                            "extra_worst_ms": extra[-1] if extra else None, "extra_round_medians_ms": paired})
            summary["met"] = (None if summary["extra_median_ms"] is None and summary["status"] in ("not run", "error")
                              else summary["extra_median_ms"] is not None and summary["status"] == "ok"
                              and summary["extra_median_ms"] <= MEDIAN_TARGET_MS
                              and summary["extra_worst_ms"] <= WORST_TARGET_MS)
            expected = "ok" if kind == "bound" else "none"
            if summary["origin_auth"] not in (None, expected):
                summary["warning"] = f"the origin saw authorization {summary['origin_auth']!r}, expected {expected!r}"
        entry["summary"] = summary


def why_not(summary: dict, timeout: float) -> str:
    status = summary.get("status")
    if status == "buffered":
        return (f"buffered: the event never arrived (waited {timeout:g} s; the response headers "
                f"{'did' if summary.get('headers_arrived') else 'did not arrive either'})")
    if status == "stalled":
        return f"stalled: an event did not arrive within {timeout:g} s after {summary['events']} had"
    if status == "error":
        return f"error: {summary.get('error')}"
    return status or "not run"


def targets(result: dict) -> list[dict]:
    found = []
    timeout = result["params"]["timeout_s"]
    for key in LATENCY_KEYS:
        entry = result["latency"].get(key)
        if not entry or key.startswith("direct"):
            continue
        s = entry["summary"]
        note = (f"worst {s['extra_worst_ms']:.2f} ms, p99 {s['extra_p99_ms']:.2f} ms over {s['events']} events"
                if s.get("extra_worst_ms") is not None else "")
        if s["status"] != "ok":
            note = (note + "; " if note else "") + why_not(s, timeout)
        found.append({"target": f"SSE extra latency per event, {label(key)}: median (ms)",
                      "value": s.get("extra_median_ms"),
                      "required": f"median ≤ {MEDIAN_TARGET_MS:g}, worst ≤ {WORST_TARGET_MS:g}", "met": s["met"],
                      "note": note})
    for kind, m in result["memory"].items():
        value = m.get("kib_per_stream")
        note = (f"{m.get('opened')} streams, {m.get('first_event_received')} received their event"
                if m.get("status") != "error" else m.get("error", ""))
        if m.get("status") == "buffered":
            note += " (buffered: the open streams' events never arrived; memory of the streams held open anyway)"
        found.append({"target": f"gateway RSS per open SSE stream, HTTP/1.1, {KINDS[kind]} (KiB)", "value": value,
                      "required": f"≤ {MEMORY_TARGET_KIB:g}", "met": None if value is None else value <= MEMORY_TARGET_KIB,
                      "note": note})
    return found


def _f(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(result: dict) -> list[str]:
    p = result["params"]
    L = ["## Streaming (SSE): extra latency per event, memory per open stream", "",
         f"Origin: this run's own asyncio TLS server on {p['origin']} (HTTP/1.1 and HTTP/2 by ALPN) sending events of "
         f"{p['event_bytes']} bytes shaped like a model API's (`data: {{\"type\":\"content_block_delta\",...}}`), one "
         "at a time: event N+1 only after the client confirmed event N on a side channel, each stamped with its "
         "CLOCK_MONOTONIC send time; the client (the benchmark's process) notes when it has the whole event. "
         f"{p['events']} events per stream and round (event 0, which carries the response headers, not counted), "
         f"{p['rounds']} rounds in a rotating order. Extra = an event's latency through the gateway − the median "
         "latency of direct over the same protocol in the same round; median and worst over every event. The gateway "
         f"runs on CPU 0, origin and client on CPU 1{'' if p['pinned'] else ' (pinning off: anywhere)'}. Bound rule: "
         f"`Authorization: Bearer ${{secrets.key}}`, an env secret of {p['secret_chars']} characters. Every wait "
         f"ends after {p['timeout_s']:g} s. ms.", ""]
    if result["latency"]:
        L += ["| configuration | events | p50 | p99 | max | extra median | extra p99 | extra worst | target | |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for key in LATENCY_KEYS:
        entry = result["latency"].get(key)
        if not entry:
            continue
        s = entry["summary"]
        if key.startswith("direct"):
            met, tail = "", "" if s["status"] == "ok" else why_not(s, p["timeout_s"])
        else:
            met = "n/a" if s["met"] is None else ("met" if s["met"] else "**missed**")
            tail = "; ".join(x for x in (why_not(s, p["timeout_s"]) if s["status"] != "ok" else "",
                                         f"origin saw {s['origin_protocol']}" if s.get("origin_protocol") else "",
                                         s.get("warning", "")) if x)
        L.append(f"| {label(key)} | {s['events']} | {_f(s['p50_ms'], 3)} | {_f(s['p99_ms'], 3)} | {_f(s['max_ms'], 3)} | "
                 f"{_f(s.get('extra_median_ms'))} | {_f(s.get('extra_p99_ms'))} | {_f(s.get('extra_worst_ms'))} | "
                 f"{met} | {tail} |")
    if result["latency"]:
        L.append("")
    if result["memory"]:
        L += [f"Memory: a fresh gateway per rule kind; RSS (all its processes) after start-up and one warm-up request, "
              f"then with {p['streams']:,} SSE responses open through it at once (HTTP/1.1, one CONNECT tunnel each, "
              "from four loopback source addresses), each sent one event by the origin and held open. KiB per stream "
              "= (RSS open − RSS idle) / streams open.", "",
              "| configuration | streams open | got their event | origin holding | RSS idle, MiB | RSS open, MiB | "
              f"KiB per stream | target ≤ {MEMORY_TARGET_KIB:g} | |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for kind, m in result["memory"].items():
            if m.get("status") == "error":
                L.append(f"| HTTP/1.1, {KINDS[kind]} | | | | | | | n/a | {m.get('error', '')} |")
                continue
            v = m["kib_per_stream"]
            L.append(f"| HTTP/1.1, {KINDS[kind]} | {m['opened']} | {m['first_event_received']} | {m['origin_holding']} | "
                     f"{_f(m['rss_idle_mib'], 1)} | {_f(m['rss_open_mib'], 1)} | {_f(v, 1)} | "
                     f"{'n/a' if v is None else 'met' if v <= MEMORY_TARGET_KIB else '**missed**'} | "
                     + ("buffered: the events never arrived" if m["status"] == "buffered" else "")
                     + (f"; {m['failed']} failed: {m['errors']}" if m.get("failed") else "")
                     + (f"; the warm-up request failed: {m['warmup_error']}" if m.get("warmup_error") else "") + " |")
        L.append("")
    for text in result["notes"]:
        L.append(f"- {text}")
    if result["notes"]:
        L.append("")
    return L
