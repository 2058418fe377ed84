"""The tables of bench_pipeline.py: medians over rounds, ratios, bounds and rooflines
(summarize), and the markdown that docs/BENCHMARKS.md quotes (render)."""
from __future__ import annotations

import statistics
from pathlib import Path

# the llama.cpp build and run that bench_pipeline.py does and the tables quote
LT_BASE_FLAGS = ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release")
LLAMA_ARGS = ["-c", "12288", "-npp", "64", "-ntg", "128", "-npl", "1,4,16,64"]
MiB = 1 << 20


def med(rounds: list, key: str):
    v = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(v) if v else None


def summarize(res: dict) -> dict:
    """Medians over rounds, ratios, bounds and rooflines (in place); returns res."""
    bw = res["bandwidth"]["GBps"] * 1e9
    runs = res["runs"]
    s = {}
    for name, rounds in runs.items():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            s[name] = {"error": rounds[-1].get("error") if rounds else "not run"}
            continue
        s[name] = {k: med(ok, k) for k in ok[0] if isinstance(ok[0][k], (int, float))}
        s[name]["decode_path"] = ok[-1].get("decode_path")
        s[name]["rounds"] = len(ok)
        s[name]["p50_rounds"] = [r["p50_ms"] for r in ok]
    plain = s.get("plain", {}).get("p50_ms")
    inv = res["weights"]
    for name, v in s.items():
        if plain and "p50_ms" in v and name != "plain" and not name.startswith(("batch", "DeepSeek")):
            v["ratio_to_plain"] = v["p50_ms"] / plain
    c = s.get("budget: half the model")
    if c and plain and "loaded_per_token" in c and res.get("expert_read"):
        rate = res["expert_read"]["GBps"] * 1e9
        c["bound_ms"] = 1.2 * (plain + c["loaded_per_token"] / rate * 1e3)
    mix = inv["mixtral"]
    if plain:
        s["plain"]["floor_ms"] = mix["bytes_per_token"] / bw * 1e3
        s["plain"]["ratio_to_floor"] = plain / s["plain"]["floor_ms"]
    e = s.get("DeepSeek-V3-shaped, plain")
    if e and "p50_ms" in e and "deepseek" in inv:
        e["floor_ms"] = inv["deepseek"]["bytes_per_token"] / bw * 1e3
        e["ratio_to_floor"] = e["p50_ms"] / e["floor_ms"]
        if plain:
            e["ratio_vs_mixtral"] = e["ratio_to_floor"] / s["plain"]["ratio_to_floor"]
    kr = res.get("kernel_rate", {}).get("macs_per_s")
    cfgm = mix
    for name, v in s.items():
        if not name.startswith("batch") or "p50_ms" not in v:
            continue
        m = v["batch"]
        v["tok_s"] = m / (v["p50_ms"] / 1e3)
        ex = cfgm["routed_expert"]
        byts = cfgm["fixed_bytes"] - cfgm["parts"]["embed"]["bytes"] + m * cfgm["parts"]["embed"]["bytes"] \
            + v["distinct_experts_per_step"] * ex["bytes"] + v["kv_bytes_per_step"]
        macs = m * cfgm["macs_per_token"] + v["attended_positions_per_step"] * res["attn_macs_per_position"]
        v["bytes_per_step"], v["macs_per_step"] = byts, macs
        v["roofline_bytes_ms"] = byts / bw * 1e3
        v["roofline_macs_ms"] = macs / kr * 1e3 if kr else None
        v["roofline_ms"] = max(x for x in (v["roofline_bytes_ms"], v["roofline_macs_ms"]) if x is not None)
        v["roofline_tok_s"] = m / (v["roofline_ms"] / 1e3)
        v["of_roofline"] = v["tok_s"] / v["roofline_tok_s"]
    lc = res.get("llama_cpp", {})
    if lc.get("runs"):
        by_b = {}
        for run in lc["runs"]:
            for row in run.get("rows", []):
                by_b.setdefault(row["B"], []).append(row)
        lc["median"] = {b: {**{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                            "S_TG min": min(r["S_TG t/s"] for r in rows),
                            "S_TG max": max(r["S_TG t/s"] for r in rows)}
                        for b, rows in sorted(by_b.items())}
        for b, row in lc["median"].items():
            name = "plain" if b == 1 else f"batch {b}"
            if name in s and "p50_ms" in s[name]:
                ours = s[name].get("tok_s") or 1e3 / s[name]["p50_ms"]
                row["colibri_tok_s"] = ours
                row["colibri_over_llamacpp"] = ours / row["S_TG t/s"]
    res["summary"] = s
    return res


def fmt(x, nd=2):
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render(res: dict) -> str:
    s = res["summary"]
    bw = res["bandwidth"]
    out = [f"Machine: {res['machine']}; kernel backend `{res['backend']}`; {res['threads']} "
           f"threads; read bandwidth {bw['GBps']:.1f} GB/s ({bw['source']} read, best of "
           f"{bw['reps']}, {bw['threads']} threads; numpy {bw['numpy']['GBps']:.1f}"
           + (f", C {bw['c']['best_GBps']:.1f}" if "c" in bw else "") + "); commit "
           f"{res['commit']}; {res['date']}; {res['rounds']} rounds, medians.", ""]
    mix, ds = res["weights"]["mixtral"], res["weights"].get("deepseek")
    out.append(f"Weights read per token: Mixtral-shaped {mix['bytes_per_token'] / MiB:.1f} MiB"
               + (f", DeepSeek-V3-shaped {ds['bytes_per_token'] / MiB:.1f} MiB" if ds else "")
               + (f"; expert files read cold at {res['expert_read']['GBps']:.2f} GB/s "
                  f"({res['expert_read']['threads']} threads, posix_fadvise DONTNEED first)"
                  if res.get("expert_read") else "")
               + (f"; q4 batch kernel {res['kernel_rate']['macs_per_s'] / 1e9:.1f} G multiply-adds/s"
                  if res.get("kernel_rate") else "") + ".")
    out += ["", "| part | configuration | per-token p50 ms | p50 per round | p90 ms | p99 ms | "
            "÷ plain | figures | target |", "|---|---|---|---|---|---|---|---|---|"]

    def rounds(v):
        return " / ".join(f"{x:.1f}" for x in v.get("p50_rounds", []))
    targets = {"b": "≤ 1.15"}
    for name, v in s.items():
        part = res["parts_of"].get(name, "?")
        if part in ("d",):
            continue
        if "error" in v:
            out.append(f"| {part} | {name} | failed: {v['error']} | | | | | | |")
            continue
        fig = [v["decode_path"] if part in "ab" else ""]
        tgt = targets.get(part, "")
        if name == "plain" and v.get("floor_ms"):
            fig = [f"floor {v['floor_ms']:.2f} ms, p50 ÷ floor {v['ratio_to_floor']:.2f}; "
                   f"{v['decode_path']}"]
        if name == "--debug routing to a file" and v.get("trace_bytes"):
            fig.append(f"trace {v['trace_bytes'] / 1024:.0f} KiB")
        if name.startswith("budget"):
            fig.append(f"hit rate {fmt(v.get('hit_rate'), 3)}, budget {v['budget'] / MiB:.0f} "
                       f"MiB (expert cache {v['capacity'] / MiB:.0f} MiB, experts "
                       f"{v['experts_total'] / MiB:.0f} MiB)")
        if part == "c":
            fig = [f"hit rate {fmt(v.get('hit_rate'), 3)}; loaded {v['loaded_per_token'] / MiB:.2f} "
                   f"MiB/token, read from disk {v['disk_read_per_token'] / MiB:.2f} MiB/token; "
                   f"stall {v['stall_ms_per_token']:.2f} ms/token; budget {v['budget'] / MiB:.0f} MiB "
                   f"(expert cache {v['capacity'] / MiB:.0f} MiB of {v['experts_total'] / MiB:.0f})"]
            if v.get("bound_ms"):
                tgt = f"≤ {v['bound_ms']:.2f} ms ({'met' if v['p50_ms'] <= v['bound_ms'] else 'not met'})"
        if part == "e":
            fig = [f"floor {v['floor_ms']:.2f} ms, p50 ÷ floor {v['ratio_to_floor']:.2f}, "
                   f"÷ Mixtral's {fmt(v.get('ratio_vs_mixtral'))}; {v['decode_path']}"]
            tgt = "≤ 1.2 × Mixtral's" + (f" ({'met' if v.get('ratio_vs_mixtral', 9) <= 1.2 else 'not met'})"
                                         if v.get("ratio_vs_mixtral") else "")
        if part == "b" and v.get("ratio_to_plain"):
            tgt += f" ({'met' if v['ratio_to_plain'] <= 1.15 else 'not met'})"
        out.append(f"| {part} | {name} | {v['p50_ms']:.2f} | {rounds(v)} | {v['p90_ms']:.2f} | {v['p99_ms']:.2f} | "
                   f"{fmt(v.get('ratio_to_plain'))} | {'; '.join(x for x in fig if x)} | {tgt} |")
    batch = [(n, v) for n, v in s.items() if n.startswith("batch")]
    lc = res.get("llama_cpp", {}).get("median", {})
    if batch or lc:
        out += ["", "| sequences | Colibri step p50 ms (p90 / p99; p50 per round) | Colibri tok/s | roofline ms "
                "(bytes / multiply-adds) | roofline tok/s | Colibri ÷ roofline | llama.cpp S_TG tok/s "
                "(rounds' range) | Colibri ÷ llama.cpp |", "|---|---|---|---|---|---|---|---|"]

        def llama(r):
            if not r:
                return "–"
            return f"{r['S_TG t/s']:.1f} ({r['S_TG min']:.1f}–{r['S_TG max']:.1f})"
        if 1 in lc and "plain" in s and "p50_ms" in s["plain"]:
            r = lc[1]
            out.append(f"| 1 (plain decode, a) | {s['plain']['p50_ms']:.2f} | {1e3 / s['plain']['p50_ms']:.1f} "
                       f"| | | | {llama(r)} | {fmt(r.get('colibri_over_llamacpp'))} |")
        for name, v in batch:
            if "error" in v:
                out.append(f"| {name} | failed: {v['error']} | | | | | | |")
                continue
            r = lc.get(v["batch"], {})
            out.append(f"| {int(v['batch'])} | {v['p50_ms']:.1f} ({v['p90_ms']:.1f} / {v['p99_ms']:.1f}; "
                       f"{rounds(v)}) | "
                       f"{v['tok_s']:.1f} | {v['roofline_ms']:.1f} ({v['roofline_bytes_ms']:.1f} / "
                       f"{fmt(v['roofline_macs_ms'], 1)}) | {v['roofline_tok_s']:.0f} | "
                       f"{v['of_roofline']:.2f} | {llama(r)} | {fmt(r.get('colibri_over_llamacpp'))} |")
    L = res.get("llama_cpp", {})
    if L.get("error"):
        out += ["", f"llama.cpp not measured: {L['error']}"]
    elif L.get("runs"):
        out += ["", f"llama.cpp: `llama-batched-bench {' '.join(LLAMA_ARGS)} -t {res['threads']}` "
                f"on `{Path(L['gguf']).name}`, from {Path(L['source']).parents[1].name}'s vendored "
                f"llama.cpp (cmake options beyond build/llamacpp's usual ones: "
                f"{' '.join(x for x in L.get('flags', '?').split() if x not in LT_BASE_FLAGS) or 'none'}); "
                f"S_TG = B x TG / T_TG."]
    if res.get("lines"):
        L = res["lines"]
        out += ["", "| forward path | lines | non-blank |", "|---|---|---|"]
        out += [f"| `{k}` | {v['lines']} | {v['non_blank']} |" for k, v in L.items()
                if k not in ("python", "c")]
        out += [f"| **{k}** | {L[k]['lines']} | {L[k]['non_blank']} |" for k in ("python", "c")]
    return "\n".join(out)
