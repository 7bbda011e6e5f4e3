"""Summaries, targets and the markdown report of a bench/run.py run (kept apart from the running)."""

from __future__ import annotations

import math
import statistics

KEEPALIVE_TARGET = 0.95  # gateway (1 worker) / bare mitmdump, keep-alive and new connections
PASSTHROUGH_TARGET = 0.90  # gateway passthrough rule / bare mitmdump passthrough
SCALING_TARGET_PER_WORKER = 0.8  # N workers >= 0.8 * N * 1 worker
POLICY_SCALING_TARGET = 1.5
RSS_GROWTH_TARGET_FRACTION = 0.10  # the streaming gateway's RSS may grow by at most 10% of the body
REFERENCES = ("mitmdump", "direct", "gateway", "mitmdump_transparent", "mitmdump_stream")


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); sorted input."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 10000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------------------------
# summaries


def summarise(raw: dict) -> dict:
    """Per figure and metric: the median per configuration over rounds, and against every reference
    configuration present: the ratio of the medians and the median/min/max of the per-round ratios."""
    summary: dict = {}
    for figure, rounds in raw.items():
        keys = list(dict.fromkeys(k for rnd in rounds for k in rnd))
        metrics = sorted({m for rnd in rounds for res in rnd.values() for m, v in res.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
        fig: dict = {}
        for metric in metrics:
            med = {k: median([rnd[k].get(metric) for rnd in rounds if k in rnd]) for k in keys}
            vs: dict = {}
            for ref in REFERENCES:
                if ref not in keys:
                    continue
                vs[ref] = {}
                for k in keys:
                    paired = [rnd[k][metric] / rnd[ref][metric] for rnd in rounds
                              if k in rnd and ref in rnd and rnd[k].get(metric) is not None and rnd[ref].get(metric)]
                    vs[ref][k] = {"ratio": ratio(med[k], med[ref]), "paired_median": median(paired),
                                  "paired_min": min(paired) if paired else None,
                                  "paired_max": max(paired) if paired else None}
            fig[metric] = {"median": med, "vs": vs}
        summary[figure] = fig
    return summary


def summarise_latency(raw: dict) -> dict:
    """Latency runs: every request's latency pooled over the rounds, per configuration; added = this
    configuration's percentile minus direct's."""
    out: dict = {}
    for figure in ("latency_keepalive", "latency_newconn"):
        rounds = raw.get(figure, [])
        if not rounds:
            continue
        keys = list(dict.fromkeys(k for rnd in rounds for k in rnd))
        fig = {}
        for k in keys:
            samples = sorted(s for rnd in rounds if k in rnd for s in rnd[k].get("samples_ms", []))
            per_round = [percentile(sorted(rnd[k]["samples_ms"]), 50) for rnd in rounds if k in rnd]
            fig[k] = {"n": len(samples), "p50_ms": percentile(samples, 50), "p90_ms": percentile(samples, 90),
                      "p99_ms": percentile(samples, 99), "mean_ms": statistics.fmean(samples) if samples else None,
                      "max_ms": samples[-1] if samples else None, "round_p50_ms": per_round,
                      "cpu_us_per_req": median([rnd[k].get("cpu_us_per_req") for rnd in rounds if k in rnd])}
        direct = fig.get("direct")
        for k, entry in fig.items():
            for q in ("p50", "p99"):
                base = direct.get(f"{q}_ms") if direct else None
                entry[f"added_{q}_ms"] = entry[f"{q}_ms"] - base if base is not None and entry[f"{q}_ms"] is not None \
                    else None
        out[figure] = fig
    return out


def summarise_scaling(raw: dict, meta: dict) -> dict:
    info = meta.get("scaling")
    if not info:
        return {}
    n = info["workers"]
    out: dict = {"workers": n, "cores_each": info["cores_each"], "target": SCALING_TARGET_PER_WORKER * n}
    for figure in ("scaling_keepalive", "scaling_newconn"):
        rounds = [r for r in raw.get(figure, []) if "gateway" in r and "gateway_workers" in r]
        if not rounds:
            continue

        def med(key, fn):
            return median([fn(r[key]) for r in rounds])

        one = med("gateway", lambda r: r["rps"])
        many = med("gateway_workers", lambda r: r["rps"])
        paired = [r["gateway_workers"]["rps"] / r["gateway"]["rps"] for r in rounds if r["gateway"]["rps"]]
        entry = {
            "rps_1": one, "rps_n": many, "ratio": ratio(many, one), "paired_median": median(paired),
            "paired_min": min(paired) if paired else None, "paired_max": max(paired) if paired else None,
            "rounds": len(rounds),
        }
        for key, suffix in (("gateway", "1"), ("gateway_workers", "n")):
            entry[f"quota_used_{suffix}"] = med(key, lambda r: statistics.fmean(r["quota_used"]) if r.get("quota_used")
                                                else None)
            entry[f"quota_used_min_{suffix}"] = med(key, lambda r: min(r["quota_used"]) if r.get("quota_used") else None)
            entry[f"loadgen_cpu_{suffix}"] = med(key, lambda r: r.get("loadgen_cpu_fraction"))
            entry[f"gateway_cores_{suffix}"] = med(key, lambda r: r.get("gateway_cores"))
            entry[f"rps_per_core_{suffix}"] = med(key, lambda r: r.get("rps_per_gateway_core"))
            entry[f"cpu_us_per_req_{suffix}"] = med(key, lambda r: r.get("cpu_us_per_req"))
            entry[f"supervisor_cpu_s_{suffix}"] = med(key, lambda r: r.get("supervisor_cpu_s"))
            entry[f"throttled_{suffix}"] = med(key, lambda r: statistics.fmean(
                [v.get("nr_throttled", 0) / v["nr_periods"] for v in r.get("throttle", {}).values() if v.get("nr_periods")]
                or [0]))
        entry["met"] = entry["ratio"] is not None and entry["ratio"] >= out["target"]
        out[figure] = entry
    return out


def summarise_idle(idle: dict) -> dict:
    out = dict(idle)
    ref = idle.get("mitmdump", {}).get("kib_per_tunnel")
    ref_total = idle.get("mitmdump", {}).get("rss_tunnels_mib")
    for key, entry in out.items():
        entry["per_tunnel_vs_mitmdump"] = ratio(entry.get("kib_per_tunnel"), ref)
        entry["rss_vs_mitmdump"] = ratio(entry.get("rss_tunnels_mib"), ref_total)
    return out


def targets(doc: dict) -> list[dict]:
    s, meta = doc["summary"], doc["meta"]
    skipped = meta.get("skipped", {})
    found: list[dict] = []

    def add(name: str, value: float | None, required: str, ok: bool | None, note: str = "") -> None:
        found.append({"target": name, "value": value, "required": required, "met": ok, "note": note})

    def vs(figure: str, key: str, ref: str, metric: str = "rps") -> dict:
        return s.get(figure, {}).get(metric, {}).get("vs", {}).get(ref, {}).get(key, {})

    configs_ran = "configs" in meta.get("groups", [])
    for figure, what in (("keepalive", "keep-alive HTTPS req/s"), ("newconn", "new TLS connections/s")):
        if not configs_ran:
            break
        r = vs(figure, "gateway", "mitmdump")
        value = r.get("ratio")
        add(f"gateway 1 worker / bare mitmdump, {what}", value, f"≥ {KEEPALIVE_TARGET}",
            None if value is None else value >= KEEPALIVE_TARGET,
            _paired(r) if value is not None else _why(skipped, "gateway", "mitmdump", figure, s))
    for figure, what in (("keepalive", "keep-alive HTTPS req/s"), ("newconn", "new TLS connections/s")):
        if not configs_ran:
            break
        a = s.get(figure, {}).get("rps", {}).get("median", {})
        value = ratio(a.get("gateway_passthrough"), a.get("mitmdump_passthrough"))
        add(f"gateway passthrough rule / mitmdump passthrough, {what}", value, f"≥ {PASSTHROUGH_TARGET}",
            None if value is None else value >= PASSTHROUGH_TARGET,
            _paired_between(doc, figure, "gateway_passthrough", "mitmdump_passthrough") if value is not None
            else _why(skipped, "gateway_passthrough", "mitmdump_passthrough", figure, s))
    sc = doc.get("scaling", {})
    for figure, what in (("scaling_keepalive", "keep-alive HTTPS req/s"), ("scaling_newconn", "new TLS connections/s")):
        entry = sc.get(figure)
        n = sc.get("workers") or meta.get("cpus")
        if entry:
            add(f"gateway {n} workers / 1 worker, {what} (each worker held to {sc['cores_each']:g} CPU)",
                entry["ratio"], f"≥ {SCALING_TARGET_PER_WORKER}·{n} = {sc['target']:.2f}", entry["met"],
                f"paired {fmt(entry['paired_median'], 2)} ({fmt(entry['paired_min'], 2)}–{fmt(entry['paired_max'], 2)})")
        elif "scaling" in meta.get("groups", []):
            add(f"gateway N workers / 1 worker, {what}", None, f"≥ {SCALING_TARGET_PER_WORKER}·N", None,
                "not measured: " + skipped.get("scaling", "no scaling rounds ran"))
    for figure, what in (("transparent_keepalive", "transparent keep-alive req/s"),
                         ("transparent_newconn", "transparent new TLS connections/s")):
        r = vs(figure, "gateway_transparent", "mitmdump_transparent")
        if r.get("ratio") is not None:
            add(f"gateway / mitmdump, {what}", r["ratio"], f"≥ {KEEPALIVE_TARGET}", r["ratio"] >= KEEPALIVE_TARGET,
                _paired(r))
    bulk = s.get("bulk", {})
    r = bulk.get("mb_per_s", {}).get("vs", {}).get("mitmdump", {}).get("gateway", {})
    if r.get("ratio") is not None:
        add("gateway / mitmdump, bulk download MB/s", r["ratio"], f"≥ {KEEPALIVE_TARGET}",
            r["ratio"] >= KEEPALIVE_TARGET, _paired(r))
    growth = bulk.get("rss_growth_mib", {}).get("median", {}).get("gateway")
    if growth is not None:
        limit = meta["bulk_mb"] * 1e6 / 2**20 * RSS_GROWTH_TARGET_FRACTION
        add(f"gateway RSS growth during a {meta['bulk_mb']} MB download, MiB", growth, f"≤ {limit:.0f} (10% of the body)",
            growth <= limit)
    policy = doc.get("policy")
    if policy:
        small, large = min(policy["rule_counts"]), max(policy["rule_counts"])
        for case, what in (("match", "a host that matches"), ("no_match", "a host that matches nothing")):
            r = policy["cases"][case]["ratio_large_small"]
            add(f"decision cost {large:,} rules / {small} rules, {what}", r, f"≤ {POLICY_SCALING_TARGET}",
                r <= POLICY_SCALING_TARGET)
    return found


def _paired(r: dict) -> str:
    if r.get("paired_median") is None:
        return ""
    return f"paired {fmt(r['paired_median'], 2)} ({fmt(r['paired_min'], 2)}–{fmt(r['paired_max'], 2)})"


def _paired_between(doc: dict, figure: str, key: str, ref: str) -> str:
    values = [rnd[key]["rps"] / rnd[ref]["rps"] for rnd in doc["raw"].get(figure, [])
              if key in rnd and ref in rnd and rnd[ref].get("rps")]
    if not values:
        return ""
    return f"paired {fmt(median(values), 2)} ({fmt(min(values), 2)}–{fmt(max(values), 2)})"


def _why(skipped: dict, key: str, ref: str, figure: str, summary: dict) -> str:
    for k in (key, ref):
        if k in skipped:
            return f"not measured: {k} skipped: {skipped[k]}"
    if figure not in summary:
        return "not measured: the configs group did not run"
    missing = [k for k in (key, ref) if k not in summary[figure].get("rps", {}).get("median", {})]
    return f"not measured: {', '.join(missing)} not selected (--configs)" if missing else "not measured"


def build_document(meta: dict, raw: dict, idle: dict, policy: dict | None, sse: dict | None = None) -> dict:
    doc = {"meta": meta, "summary": summarise({k: v for k, v in raw.items() if not k.startswith("latency")}),
           "latency": summarise_latency(raw), "idle": summarise_idle(idle), "scaling": summarise_scaling(raw, meta),
           "policy": policy, "streaming": sse, "raw": raw}
    doc["targets"] = targets(doc)
    if sse:
        from lib import sse_report  # bench/lib/sse_report.py: the streaming group's targets

        doc["targets"] += sse_report.targets(sse)
    return doc


# --------------------------------------------------------------------------------------------
# markdown


def build_markdown(doc: dict) -> str:
    meta, s = doc["meta"], doc["summary"]
    labels = meta.get("config_labels", {})
    configs = meta.get("configs", [])
    L: list[str] = [f"# Egress gateway benchmark — {meta['started']}", ""]
    groups = meta.get("groups", [])
    lat = meta.get("latency", {})
    L.append(f"Mode **{meta['mode']}** ({', '.join(groups)}): {meta['rounds_done']} interleaved rounds; throughput runs "
             f"hey -c {meta['concurrency']} for {meta['duration']:g} s; latency runs hey -c 1 at "
             f"{lat.get('rate', 0):g} req/s (keep-alive) and {lat.get('conn_rate', 0):g} conn/s (new connections) for "
             f"{lat.get('duration', 0):g} s; CPU pinning: "
             f"{'proxies on CPU 0 (the N-worker gateway on every CPU), nginx/hey/curl on CPU 1' if meta.get('pinned') else 'off'}"
             f"{'; nice ' + str(meta['nice']) if meta.get('nice') else ''}"
             f"{'; gateway with --audit-log' if meta.get('gateway_audit_log') else ''}.")
    L.append(f"Machine: {meta.get('machine', '?')}. Commit {meta['commit']}"
             f"{' (+ uncommitted changes)' if meta['dirty'] else ''}; mitmproxy {meta['mitmproxy']}; "
             f"{meta.get('nginx', 'nginx n/a')}; {meta.get('squid', 'squid n/a')}; Python {meta['python']}. "
             f"Load average at start {meta['loadavg_start']}.")
    if meta.get("loadavg_rounds"):
        L.append(f"Load average (1/5/15 min) at the start of each round: {' | '.join(meta['loadavg_rounds'])}.")
    L.append("")

    if doc["targets"]:
        L += ["## Targets", "", "| target | measured | required | met | |", "|---|---:|---|---|---|"]
        for t in doc["targets"]:
            met = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
            L.append(f"| {t['target']} | {fmt(t['value'], 2)} | {t['required']} | {met} | {t['note']} |")
        L.append("")

    if "keepalive" in s or "newconn" in s:
        L += _throughput_table(doc, configs, labels)
    if doc["latency"]:
        L += _latency_table(doc, configs, labels)
    if "keepalive" in s or doc["idle"]:
        L += _cost_table(doc, configs, labels)
    if doc["scaling"] or "scaling" in meta.get("skipped", {}):
        L += _scaling_section(doc)
    if any(f in s for f in ("transparent_keepalive", "transparent_newconn", "bulk")):
        L += _pair_tables(doc)
    if doc.get("policy"):
        L += _policy_table(doc["policy"])
    if doc.get("streaming"):
        from lib import sse_report  # bench/lib/sse_report.py

        L += sse_report.markdown(doc["streaming"])
    L += _noise(doc)
    if meta.get("skipped"):
        L.append("Skipped configurations:")
        L.extend(f"- {k}: {v}" for k, v in meta["skipped"].items())
        L.append("")
    if meta.get("warnings"):
        L.append("Warnings:")
        L.extend(f"- {w}" for w in meta["warnings"])
        L.append("")
    L += _per_round(doc)
    return "\n".join(L) + "\n"


def _throughput_table(doc: dict, configs: list[str], labels: dict) -> list[str]:
    s = doc["summary"]
    L = ["## (1, 2) Configurations side by side: throughput, as ratios against bare mitmdump and against direct", "",
         "Medians over rounds; × = ratio of the medians; 'paired' = median (min–max) of the per-round ratios to "
         "mitmdump (each round runs every configuration back to back, in a rotating order).", "",
         "| configuration | keep-alive req/s | × mitmdump | paired | × direct | new TLS conn/s | × mitmdump | paired | × direct |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in configs:
        cells = []
        for figure in ("keepalive", "newconn"):
            entry = s.get(figure, {}).get("rps", {})
            value = entry.get("median", {}).get(key)
            vm = entry.get("vs", {}).get("mitmdump", {}).get(key, {})
            vd = entry.get("vs", {}).get("direct", {}).get(key, {})
            paired = (f"{fmt(vm.get('paired_median'), 2)} ({fmt(vm.get('paired_min'), 2)}–{fmt(vm.get('paired_max'), 2)})"
                      if vm.get("paired_min") is not None and key != "mitmdump" else "")
            cells += [fmt(value), fmt(vm.get("ratio"), 2), paired, fmt(vd.get("ratio"), 3)]
        L.append(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    L.append("")
    lg = []
    for figure, name in (("keepalive", "keep-alive"), ("newconn", "new connections")):
        fr = s.get(figure, {}).get("loadgen_cpu_fraction", {}).get("median", {})
        proxied = {k: v for k, v in fr.items() if k != "direct" and v is not None}
        if proxied:
            lg.append(f"{name} {min(proxied.values()):.2f}–{max(proxied.values()):.2f} of a CPU through a proxy"
                      + (f", {fr['direct']:.2f} direct" if fr.get("direct") is not None else ""))
    if lg:
        L.append("Load generator (hey + nginx, CPU-seconds per second of the run, both on CPU 1 when pinned): "
                 + "; ".join(lg) + ". Below 1.0 through a proxy: the proxy, not the load generator, set the pace. "
                 "Direct is limited by hey and nginx themselves.")
        L.append("")
    return L


def _latency_table(doc: dict, configs: list[str], labels: dict) -> list[str]:
    lat, meta = doc["latency"], doc["meta"]
    rate = meta.get("latency", {})
    L = ["## (7) Latency at a fixed moderate rate (not saturation)", "",
         f"One hey worker with a rate limit (-c 1 -q): keep-alive at {rate.get('rate', 0):g} requests/s, new "
         f"connections at {rate.get('conn_rate', 0):g}/s, so the proxy is mostly idle and latency is not queueing "
         "(with -c 2 hey's workers tick in step and every other request would queue). Every request's latency (hey -o csv), pooled "
         "over the rounds; added = this configuration's percentile minus direct's. ms.", "",
         "| configuration | keep-alive p50 | p99 | added p50 | added p99 | n | new-conn p50 | p99 | added p50 | added p99 | n |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in configs:
        cells = []
        for figure in ("latency_keepalive", "latency_newconn"):
            e = lat.get(figure, {}).get(key, {})
            cells += [fmt(e.get("p50_ms"), 2), fmt(e.get("p99_ms"), 2), fmt(e.get("added_p50_ms"), 2),
                      fmt(e.get("added_p99_ms"), 2), str(e.get("n", ""))]
        L.append(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    L.append("")
    return L


def _cost_table(doc: dict, configs: list[str], labels: dict) -> list[str]:
    s, idle, meta = doc["summary"], doc["idle"], doc["meta"]
    L = [f"## (8) Cost: proxy CPU per request and memory with {meta.get('idle_tunnels', 1000):,} idle tunnels", "",
         "CPU: utime+stime of every process of the proxy (supervisor and workers summed) during the throughput runs, "
         "per request answered. RSS: VmRSS summed over the proxy's processes (PSS in the JSON), before and with the "
         "idle tunnels open (each: CONNECT, TLS established through the tunnel, one request answered, then idle), measured "
         "after the throughput rounds; KiB per tunnel = the growth / tunnels, which memory a process kept from the "
         "rounds can make smaller.", "",
         "| configuration | CPU µs/req keep-alive | × mitmdump | CPU µs/new conn | × mitmdump | processes | RSS idle, MiB | RSS with tunnels, MiB | × mitmdump | KiB per tunnel |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in configs:
        cells = []
        for figure in ("keepalive", "newconn"):
            entry = s.get(figure, {}).get("cpu_us_per_req", {})
            cells += [fmt(entry.get("median", {}).get(key), 0),
                      fmt(entry.get("vs", {}).get("mitmdump", {}).get(key, {}).get("ratio"), 2)]
        i = idle.get(key, {})
        cells += [str(i.get("processes", "")), fmt(i.get("rss_idle_mib")), fmt(i.get("rss_tunnels_mib")),
                  fmt(i.get("rss_vs_mitmdump"), 2), fmt(i.get("kib_per_tunnel"))]
        L.append(f"| {labels.get(key, key)} | " + " | ".join(cells) + " |")
    L.append("")
    return L


def _scaling_section(doc: dict) -> list[str]:
    sc, meta = doc["scaling"], doc["meta"]
    L = ["## (9) Scaling: N workers against 1 worker", ""]
    if not sc:
        L += [f"Not measured: {meta.get('skipped', {}).get('scaling', 'no scaling rounds ran')}.", ""]
        return L
    n, q = sc["workers"], sc["cores_each"]
    L.append(f"Method: on a machine this small the load generator (hey) and the origin (nginx) compete with the "
             f"workers for the same cores, so N unthrottled workers cannot show what N cores would do. Instead every "
             f"worker process is held to a CPU quota of {q:g} core ({meta.get('scaling', {}).get('quota', '')})"
             + (", and during these runs every gateway process is pinned to CPU 0 while hey and nginx keep CPU 1"
                if meta.get("scaling", {}).get("pinned_to_cpu0") else
                ", and may run on any CPU (hey and nginx stay on CPU 1; the quotas leave room for them)")
             + f": 1 worker gets {q:g} of a core, {n} workers get {n} × {q:g}. The target compares throughput: "
             f"{n} workers ≥ {SCALING_TARGET_PER_WORKER}·{n} × 1 worker. 'Quota used' (worker CPU-seconds / "
             "(quota × wall time), mean over workers) near 1.0 shows the workers, not the load generator, were the "
             "limit; 'load generator' is hey + nginx CPU-seconds per second. 'Req per gateway CPU-s' is the "
             "throughput divided by the CPU the gateway used (supervisor included): when it differs between 1 and "
             f"{n} workers, the throughput ratio is not only parallelism (a lone throttled worker runs less "
             "efficiently per CPU-second than several; SO_REUSEPORT spreads connections by hash, not by load).")
    L.append("")
    L.append(f"| figure | 1 worker | {n} workers | ratio | paired | target | met | quota used 1 / {n} | "
             f"load generator 1 / {n} | req per gateway CPU-s 1 / {n} |")
    L.append("|---|---:|---:|---:|---:|---|---|---|---|---|")
    for figure, name in (("scaling_keepalive", "keep-alive req/s"), ("scaling_newconn", "new TLS conn/s")):
        e = sc.get(figure)
        if not e:
            continue
        L.append(f"| {name} | {fmt(e['rps_1'])} | {fmt(e['rps_n'])} | {fmt(e['ratio'], 2)} | "
                 f"{fmt(e['paired_median'], 2)} ({fmt(e['paired_min'], 2)}–{fmt(e['paired_max'], 2)}) | "
                 f"≥ {sc['target']:.2f} | {'met' if e['met'] else '**missed**'} | "
                 f"{fmt(e['quota_used_1'], 2)} / {fmt(e['quota_used_n'], 2)} | "
                 f"{fmt(e['loadgen_cpu_1'], 2)} / {fmt(e['loadgen_cpu_n'], 2)} | "
                 f"{fmt(e['rps_per_core_1'], 0)} / {fmt(e['rps_per_core_n'], 0)} |")
    L.append("")
    sup = [sc[f].get("supervisor_cpu_s_n") for f in ("scaling_keepalive", "scaling_newconn") if sc.get(f)]
    if any(v is not None for v in sup):
        L.append(f"The supervisor process (not throttled) used {', '.join(fmt(v, 2) for v in sup)} CPU-seconds per "
                 "run; it is counted in the CPU per request.")
        L.append("")
    return L


def _pair_tables(doc: dict) -> list[str]:
    s, meta, raw = doc["summary"], doc["meta"], doc["raw"]
    L = []
    rows = []

    def row(name: str, figure: str, metric: str, a_key: str, b_key: str, digits: int = 1) -> None:
        entry = s.get(figure, {}).get(metric)
        if not entry:
            return
        a, b = entry["median"].get(a_key), entry["median"].get(b_key)
        r = entry.get("vs", {}).get(a_key, {}).get(b_key, {})
        paired = (f"{fmt(r.get('paired_median'), 2)} ({fmt(r.get('paired_min'), 2)}–{fmt(r.get('paired_max'), 2)})"
                  if r.get("paired_min") is not None else "")
        rows.append(f"| {name} | {fmt(a, digits)} | {fmt(b, digits)} | {fmt(ratio(b, a), 2)} | {paired} |")

    if "transparent_keepalive" in s or "transparent_newconn" in s:
        t = meta.get("transparent_topology", {})
        L.append("## Transparent mode (5, 6)")
        L.append("")
        if t:
            L.append(f"hey in a sandbox namespace (no proxy settings) → docker/sandbox-net.sh's iptables REDIRECT → "
                     f"the proxy's transparent listener in namespace {t['gateway_ns']} → veth → nginx on {t['origin']} "
                     f"in namespace {t['internet_ns']}; one sandbox per proxy "
                     f"({'; '.join(f'{r}: {v}' for r, v in t['sandboxes'].items())}).")
            L.append("")
        L += ["| figure | mitmdump (a) | gateway (b) | b/a | paired b/a |", "|---|---:|---:|---:|---:|"]
        rows.clear()
        for figure, name in (("transparent_keepalive", "(5) keep-alive"), ("transparent_newconn", "(6) new TLS conn")):
            unit = "req/s" if "keepalive" in figure else "conn/s"
            row(f"{name} {unit}", figure, "rps", "mitmdump_transparent", "gateway_transparent")
            row(f"{name} p50 latency (saturated), ms", figure, "p50_ms", "mitmdump_transparent", "gateway_transparent")
            row(f"{name} proxy CPU µs per request", figure, "cpu_us_per_req", "mitmdump_transparent",
                "gateway_transparent", 0)
        L += rows + [""]
    if "bulk" in s:
        L.append(f"## Bulk download (3): {meta['bulk_mb']} MB through the proxy")
        L.append("")
        L += ["| figure | mitmdump (a) | gateway (b) | b/a | paired b/a |", "|---|---:|---:|---:|---:|"]
        rows.clear()
        row("MB/s", "bulk", "mb_per_s", "mitmdump", "gateway")
        row("proxy CPU per MB, ms", "bulk", "cpu_ms_per_mb", "mitmdump", "gateway")
        row("RSS before, MiB", "bulk", "rss_before_mib", "mitmdump", "gateway")
        row("RSS peak during the download, MiB", "bulk", "rss_peak_mib", "mitmdump", "gateway")
        row("RSS growth (peak − before), MiB", "bulk", "rss_growth_mib", "mitmdump", "gateway")
        L += rows + [""]
        bulk = s["bulk"]
        stream = bulk.get("mb_per_s", {}).get("median", {}).get("mitmdump_stream")
        if stream is not None:
            r = bulk["mb_per_s"]["vs"].get("mitmdump_stream", {}).get("gateway", {})
            growth_s = bulk.get("rss_growth_mib", {}).get("median", {}).get("mitmdump_stream")
            cpu = bulk.get("cpu_ms_per_mb", {}).get("vs", {}).get("mitmdump_stream", {}).get("gateway", {})
            L.append(f"Like-for-like: mitmdump with `stream_large_bodies=1m` (a') — the gateway forces that option, "
                     f"bare mitmdump buffers whole bodies — did {fmt(stream)} MB/s (RSS growth {fmt(growth_s)} MiB); "
                     f"gateway/(a') = {fmt(r.get('ratio'), 2)}, {_paired(r)}; proxy CPU per MB gateway/(a') = "
                     f"{fmt(cpu.get('ratio'), 2)}.")
            L.append("")
    _ = raw
    return L


def _policy_table(policy: dict) -> list[str]:
    small, large = min(policy["rule_counts"]), max(policy["rule_counts"])
    first = next(iter(policy["cases"].values()))["ns_samples"]
    L = [f"## One policy decision (4): `Engine.check_request`, ns/decision (median of "
         f"{len(first[small] if small in first else first[str(small)])} timeit repeats × {policy['number']:,})", "",
         f"| host | {small} rules | {large:,} rules | {large:,}/{small} | target | met |", "|---|---:|---:|---:|---|---|"]
    for case, name in (("match", "matches (origin.bench)"), ("no_match", "matches nothing")):
        c = policy["cases"][case]
        r = c["ratio_large_small"]
        L.append(f"| {name} | {fmt(c['ns_median'][small], 0)} | {fmt(c['ns_median'][large], 0)} | {r:.2f} | "
                 f"≤ {POLICY_SCALING_TARGET} | {'met' if r <= POLICY_SCALING_TARGET else '**missed**'} |")
    L.append("")
    L.append(f"Compiling the policies (`compile_policy` on generated YAML): {small} rules "
             f"{policy['compile_s'][small]:.2f} s, {large:,} rules {policy['compile_s'][large]:.1f} s.")
    L.append("")
    return L


def _paired_text(values: list[float]) -> str:
    return f"{fmt(median(values), 2)} ({fmt(min(values), 2)}–{fmt(max(values), 2)})" if values else ""


def _noise(doc: dict) -> list[str]:
    raw = doc["raw"]
    spreads = []
    for figure, key, metric, name in (("keepalive", "mitmdump", "rps", "mitmdump keep-alive req/s"),
                                      ("newconn", "mitmdump", "rps", "mitmdump new connections/s"),
                                      ("scaling_keepalive", "gateway", "rps", "throttled 1-worker keep-alive req/s"),
                                      ("transparent_keepalive", "mitmdump_transparent", "rps",
                                       "transparent mitmdump keep-alive req/s"),
                                      ("bulk", "mitmdump", "mb_per_s", "mitmdump bulk MB/s")):
        values = [rnd[key][metric] for rnd in raw.get(figure, []) if rnd.get(key, {}).get(metric)]
        if len(values) >= 2:
            spreads.append(f"{name} {fmt(min(values))}–{fmt(max(values))} "
                           f"(±{(max(values) - min(values)) / 2 / statistics.median(values):.0%} of the median)")
    if not spreads:
        return []
    return ["Noise: one configuration alone varied across rounds by " + "; ".join(spreads) + ". A ratio closer to "
            "its target than that spread is within the noise of this machine.", ""]


def _per_round(doc: dict) -> list[str]:
    raw = doc["raw"]
    if not raw:
        return []
    L = ["<details><summary>Per-round values</summary>", ""]
    for figure, metric, unit in (("keepalive", "rps", "req/s"), ("newconn", "rps", "conn/s"),
                                 ("scaling_keepalive", "rps", "req/s"), ("scaling_newconn", "rps", "conn/s"),
                                 ("transparent_keepalive", "rps", "req/s"), ("transparent_newconn", "rps", "conn/s"),
                                 ("bulk", "mb_per_s", "MB/s"), ("bulk", "rss_peak_mib", "MiB peak RSS")):
        if figure not in raw:
            continue
        parts = []
        for i, rnd in enumerate(raw[figure]):
            parts.append(f"r{i + 1}: " + ", ".join(f"{k}={fmt(v.get(metric))}" for k, v in rnd.items()))
        L.append(f"- {figure} {unit}: " + "; ".join(parts))
    L += ["", "</details>"]
    return L
