"""The regime map's report: a Markdown table per cell, heatmaps of the push/pull and auto/best ratios,
and the generated section of docs/results/regime-map.md, from regime_map.json.

Every statement in the generated text names the cells behind it; a ratio whose 95% interval spans
1.0 is "cannot tell" and is never counted for either side, nor is a "screen" (beyond 1.0 on fewer runs a
side than regime.MIN_RUNS, or unpaired), which is shown as such.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from kvpush.bench.calibrate import CalibrationConfig
from kvpush.bench.modes import variant_name
from kvpush.bench.regime import MIN_RUNS


def markers(grid: str) -> tuple[str, str]:
    """The doc's lines around one grid's generated section (each grid has its own)."""
    return f"<!-- regime-map:{grid}:begin -->", f"<!-- regime-map:{grid}:end -->"


LABELS = {"ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99", "tpot_p50": "TPOT p50"}
PANELS = (("push_vs_pull", "ttft_p50", "push/pull TTFT p50"), ("push_vs_pull", "ttft_p99", "push/pull TTFT p99"),
          ("push_vs_pull", "tpot_p50", "push/pull TPOT p50"), ("auto_vs_best", "ttft_p50", "auto/best fixed TTFT p50"))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _cell_ratio(c: dict, group: str, key: str) -> dict | None:
    """A ratio of the cell; in a map written before screens were marked, marked here from its runs a side
    (or, older still, the fewest runs of any mode in the cell)."""
    g = c.get(group) or {}
    r = g.get(key)
    if not isinstance(r, dict):
        return None
    if "screen" not in r and key in MIN_RUNS:
        runs = r.get("runs") or min((int(m.get("runs") or 0) for m in (c.get("modes") or {}).values()), default=0)
        r = {**r, "screen": runs < MIN_RUNS[key]}
    return r


def _ratio_text(r: dict | None) -> str:
    if r is None:
        return "-"
    mark = ("" if r["verdict"] == "cannot tell" else f" screen: {r['verdict']}" if r.get("screen")
            else " **" + r["verdict"] + "**")
    return f"{r['ratio']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]" + (mark or " cannot tell")


def markdown(doc: dict[str, Any]) -> str:
    """One row per cell: TTFT p50 per mode, the push/pull ratios, auto against the best fixed mode."""
    cells = doc["cells"]
    modes = [m for m in doc["config"]["modes"] if any(m in c["modes"] for c in cells)]
    head = ("| cell (link in/out load prefix) | rate | " + " | ".join(f"{m} TTFT p50" for m in modes)
            + " | push/pull TTFT p50 | push/pull TTFT p99 | push/pull TPOT p50 | auto / best fixed TTFT p50 "
              "| auto / best p99 | auto routes |")
    emulated = any(c.get("emulation") for c in cells)
    if emulated:  # rates and times in emulated time; each cell's valid runs (bench/emulation.py's rule)
        head = head.replace("| rate |", "| rate (emulated req/s) | valid runs |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        best = (c.get("auto_vs_best") or {}).get("best", "")
        routes = ", ".join(f"{k} {v:.0f}" for k, v in (c.get("routes") or {}).items() if v)
        em = c.get("emulation")
        rate = [f"{c['rate'] * em['time_scale']:.1f}", f"{em['valid_runs']}/{em['runs']}"] if em else \
            ["-", "-"] if emulated else [f"{c['rate']:.2f}"]
        row = [c["name"], *rate, *[_ms((c["modes"].get(m) or {}).get("ttft_p50_ms")) for m in modes],
               _ratio_text(_cell_ratio(c, "push_vs_pull", "ttft_p50")),
               _ratio_text(_cell_ratio(c, "push_vs_pull", "ttft_p99")),
               _ratio_text(_cell_ratio(c, "push_vs_pull", "tpot_p50")),
               (best + ": " if best else "") + _ratio_text(_cell_ratio(c, "auto_vs_best", "ttft_p50")),
               _ratio_text(_cell_ratio(c, "auto_vs_best", "ttft_p99")), routes or "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _names(cells: list[dict], group: str, key: str, outcome: str) -> list[str]:
    """Cells whose verdict is `outcome` ("cannot tell" also where a screen saw a difference, see _screens)."""
    return [c["name"] for c in cells if (r := _cell_ratio(c, group, key)) is not None
            and (r["verdict"] if not r.get("screen") else "cannot tell") == outcome]


def _worse(cells: list[dict], group: str, key: str) -> list[str]:
    """Cells where auto lost to the `best` mode the group names, beyond the interval (screens left out)."""
    return [c["name"] for c in cells if (r := _cell_ratio(c, group, key)) is not None and not r.get("screen")
            and r["verdict"] == f"{c[group]['best']} better"]


def _judged(cells: list[dict], group: str, key: str) -> int:
    """How many cells have a ratio there that counts as a verdict (not a screen)."""
    return sum(1 for c in cells if (r := _cell_ratio(c, group, key)) is not None and not r["screen"])


def _screens(cells: list[dict], group: str, key: str) -> str:
    """' (N screen verdict(s) ...)' for differences seen on too few runs a side to count; else empty."""
    seen = [f"{c['name']} {r['verdict']}" for c in cells if (r := _cell_ratio(c, group, key)) is not None
            and r.get("screen") and r["verdict"] != "cannot tell"]
    if not seen:
        return ""
    return (f" ({len(seen)} difference(s) beyond the interval on fewer runs a side than a verdict needs, counted as "
            f"cannot tell: {'; '.join(seen)})")


def findings(doc: dict[str, Any]) -> str:
    """Plain-words boundaries, each with the cells behind it."""
    cells = doc["cells"]
    out = []
    for key, what in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("tpot_p50", "TPOT p50")):
        push, pull = _names(cells, "push_vs_pull", key, "push better"), _names(cells, "push_vs_pull", key, "pull better")
        tell = _names(cells, "push_vs_pull", key, "cannot tell")
        out.append(f"- **{what}**: push better in {len(push)} cell(s){': ' + '; '.join(push) if push else ''}; "
                   f"pull better in {len(pull)}{': ' + '; '.join(pull) if pull else ''}; "
                   f"cannot tell in {len(tell)}{_screens(cells, 'push_vs_pull', key)}.")
    worse = _worse(cells, "auto_vs_best", "ttft_p50")
    better = _names(cells, "auto_vs_best", "ttft_p50", "auto better")
    n = _judged(cells, "auto_vs_best", "ttft_p50")
    out.append(f"- **auto vs the best fixed mode of each cell (TTFT p50)**: worse beyond the interval in "
               f"{len(worse)} of {n} cell(s){': ' + '; '.join(worse) if worse else ''}; better in {len(better)}"
               f"{': ' + '; '.join(better) if better else ''}{by_chance(len(worse), n)}"
               f"{_screens(cells, 'auto_vs_best', 'ttft_p50')}.")
    forced = [c for c in cells if _cell_ratio(c, "auto_vs_forced", "ttft_p50") is not None]
    if forced:
        for key, what in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("tpot_p50", "TPOT p50")):
            worse = _worse(forced, "auto_vs_forced", key)
            better = _names(forced, "auto_vs_forced", key, "auto better")
            out.append(f"- **auto vs the best route forced on its own deployment ({what})**: worse beyond the interval "
                       f"in {len(worse)} of {len(forced)} cell(s){': ' + '; '.join(worse) if worse else ''}; better in "
                       f"{len(better)}{': ' + '; '.join(better) if better else ''}{by_chance(len(worse), _judged(forced, 'auto_vs_forced', key))}"
                       f"{_screens(forced, 'auto_vs_forced', key)}.")
    for c in cells:
        each = c.get("auto_vs_each") or {}
        if c["cell"]["prefix"] == "mixed" and each:
            out.append(f"- **auto vs each fixed mode on the mixed workload** ({c['name']}): "
                       + "; ".join(_each_parts(each)) + ".")
    out += _variant_lines(doc, cells)
    out += aa_lines(cells)
    out += [f"- **routes forced on an auto deployment alone vs the same route's own deployment, same prompts** "
            f"({c['name']}): " + "; ".join(_each_parts(c["forced_vs_fixed"], "TTFT p50", "ttft_p50")) + "."
            for c in cells if c.get("forced_vs_fixed")]
    return "\n".join(out)


def by_chance(k: int, n: int, p: float = 0.025) -> str:
    """How many one-sided verdicts ("worse") n judged cells give by chance where nothing differs, if the
    intervals hold their 95% (each side 2.5%), and the chance of k or more; empty for n = 0. A floor: the
    "best" that auto is set against is picked from the same runs (the fastest p50), which makes "worse"
    likelier than 2.5% where nothing differs, and several metrics tested give more chances."""
    if n <= 0:
        return ""
    tail = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
    return (f" (where nothing differs, intervals that hold their 95% say \"worse\" in at least {p:.1%} of the "
            f"{n} judged cells: {n * p:.1f} expected, {k} or more with chance {tail:.2f} or more)")


def aa_tally(cells: list[dict], out: dict[tuple[str, int], list[int]] | None = None) -> dict[tuple[str, int], list[int]]:
    """Per (metric, runs a side), [beyond the interval, compared] over every twin (M#N) against its mode M,
    added to `out` where given (several maps)."""
    out = {} if out is None else out
    for c in cells:
        for ratios in (c.get("aa") or {}).values():
            for key in LABELS:
                if isinstance(r := ratios.get(key), dict):
                    tally_verdict(out, (key, int(r.get("runs") or 0)), r)
    return out


def tally_verdict(out: dict[tuple[str, int], list[int]], key: tuple[str, int], ratio: dict) -> None:
    """Count one A/A ratio under `key`: [beyond the interval, compared]."""
    count = out.setdefault(key, [0, 0])
    count[0] += ratio["verdict"] != "cannot tell"
    count[1] += 1


def aa_lines(cells: list[dict]) -> list[str]:
    """The A/A check: how often a mode's twin (same prompts, same processes) differed from it beyond the
    interval; a 95% interval should do so ~5% of the time. Nothing without twins."""
    tally = aa_tally(cells)
    if not tally:
        return []
    twins = sorted({t for c in cells for t in (c.get("aa") or {})})
    runs = sorted({n for _, n in tally})
    counts = {key: [0, 0] for key in LABELS}
    for (key, _), (k, n) in tally.items():
        counts[key][0] += k
        counts[key][1] += n
    parts = [f"{LABELS[key]} {k} of {n}" for key, (k, n) in counts.items()]
    return [f"- **A/A check** ({', '.join(twins)}: each mode run twice per repeat on the same prompts and processes, "
            f"{'/'.join(map(str, runs))} run(s) a side): beyond the 95% interval in " + ", ".join(parts)
            + " (expected ~5%)."]


def _each_parts(each: dict[str, dict], *extra: str) -> list[str]:
    """'mode: TTFT p99 ..., TPOT p50 ...' per mode compared with (after `extra`: name, key pairs)."""
    first = list(zip(extra[::2], extra[1::2], strict=True))
    return [f"{m}: " + ", ".join(f"{name} {_ratio_text(r.get(key))}" for name, key in
                                 [*first, ("TTFT p99", "ttft_p99"), ("TPOT p50", "tpot_p50")]) for m, r in each.items()]


def _variant_lines(doc: dict[str, Any], cells: list[dict]) -> list[str]:
    """Per auto variant (its own deployment, auto's proxy or its instances with other flags): against auto
    and each fixed mode, per cell."""
    flags = (doc.get("config") or {}).get("auto_variants") or {}
    out = []
    for c in cells:
        for v, s in (c.get("variants") or {}).items():
            parts = _each_parts(s.get("vs_each") or {})
            vs = s.get("vs_auto") or {}
            if vs:
                parts.append(f"auto: TTFT p50 {_ratio_text(vs.get('ttft_p50'))}, TTFT p99 {_ratio_text(vs.get('ttft_p99'))},"
                             f" TPOT p50 {_ratio_text(vs.get('tpot_p50'))}")
            routes = ", ".join(f"{k} {n:.0f}" for k, n in (s.get("routes") or {}).items() if n)
            out.append(f"- **{v}** (auto with `{shlex.join(flags.get(variant_name(v) or '', []))}`) vs each mode "
                       f"({c['name']}): " + "; ".join(parts) + f"; routes of its measured requests {routes or '-'}.")
    return out


def heatmaps(doc: dict[str, Any], out: Path) -> Path | None:
    """One panel per ratio: rows (link, prompt/output length), columns (load, prefix); the colour is
    log2 of the ratio (blue: the first mode faster), the text the ratio, '~' when cannot tell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = doc["cells"]
    rows = sorted({(c["cell"]["link"], c["cell"]["input_len"], c["cell"]["output_len"]) for c in cells},
                  key=lambda r: (r[0] != "full", r[1], r[2]))
    cols = sorted({(c["cell"]["prefix"], c["cell"]["load"]) for c in cells})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 1.0 + 0.55 * len(rows)), squeeze=False)
    for ax, (group, key, title) in zip(axes[0], PANELS, strict=True):
        grid = [[math.nan] * len(cols) for _ in rows]
        for c in cells:
            r = _cell_ratio(c, group, key)
            i = rows.index((c["cell"]["link"], c["cell"]["input_len"], c["cell"]["output_len"]))
            j = cols.index((c["cell"]["prefix"], c["cell"]["load"]))
            if r is not None:
                grid[i][j] = math.log2(r["ratio"])
                tag = "~" if r["verdict"] == "cannot tell" else "?" if r.get("screen") else ""
                ax.text(j, i, f"{r['ratio']:.2f}{tag}", ha="center",
                        va="center", fontsize=8)
        ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(cols)), [f"{p}\n{load:.0%}" for p, load in cols], fontsize=7)
        ax.set_yticks(range(len(rows)), [f"{lk} {i}/{o}" for lk, i, o in rows], fontsize=7)
    fig.suptitle("ratio < 1 (blue): the first mode is faster; ~ = the 95% interval spans 1 (cannot tell); "
                 "? = it does not, on too few runs a side to tell (a screen)", fontsize=8)
    fig.tight_layout()
    path = out / "regime_map.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def section(doc: dict[str, Any], png: str | None) -> str:
    cfg = doc["config"]
    command = cfg.get("command") or "benchmarks/regime_map.py"
    minutes = doc.get("elapsed_s", 0) / 60
    begin, end = markers(section_name(cfg))
    if cfg.get("confirm_of"):
        what = (f"confirmation of `{cfg['confirm_of']}`: the {len(doc.get('flagged', doc['cells']))} cell(s) where "
                "auto's TTFT p50 or p99 differed from the best fixed mode's (or best forced route's) beyond the "
                "interval, either way, "
                f"run {cfg.get('repeats', 1)} more time(s) per mode at the screen's rate on fresh prompts, "
                f"{minutes:.0f} min, on deployments of its own (auto's cost model starting cold); every ratio below is "
                "over the screen's runs and these pooled, the paired ones resampling runs as well as their "
                "requests, so that their interval carries the drift between runs and a verdict needs the runs "
                "to agree")
        extra = ["", *confirm_table(doc)]
    else:
        what = (f"{cfg['grid']} grid, {len(doc['cells'])} cells, {minutes:.0f} min, "
                f"{cfg.get('repeats', 1)} run(s) of {cfg['min_prompts']}-{cfg['max_prompts']} requests per mode and "
                "cell, pooled, the order of the modes rotating")
        if cfg.get("repeats", 1) == 1:
            what += ("; **one run per mode: a screen**, its intervals cover one run's requests and leave out the "
                     "variance between runs (A/A checks found 13-22% of TTFT p50 and 37-56% of TTFT p99 and TPOT "
                     "verdicts beyond such intervals between two runs of the same mode): verdicts need more runs "
                     "(`--repeats`, or `--confirm`)")
        extra = []
    need = ", ".join(f"{LABELS[k]} {n}" for k, n in MIN_RUNS.items())
    return "\n".join([
        begin,
        *emulated_lines(doc),
        f"Generated from `{command}` ({what}; loads are fractions of the slower of push and pull at full "
        "concurrency; 95% bootstrap intervals; **bold** = the interval excludes 1 on enough runs a side "
        f"({need}); \"screen\" = it excludes 1 on fewer, counted as cannot tell).",
        "",
        findings(doc),
        *calibration_lines(doc),
        *extra,
        "",
        *([f"![regime map]({png})", ""] if png else []),
        markdown(doc),
        end,
    ])


def emulated_lines(doc: dict[str, Any]) -> list[str]:
    """For a map of emulated instances: what they emulate, and how many runs kept the clock."""
    ems = [c["emulation"] for c in doc["cells"] if c.get("emulation")]
    if not ems:
        return []
    profiles = ", ".join(sorted({p for e in ems for p in e["profiles"]}))
    valid, runs = sum(e["valid_runs"] for e in ems), sum(e["runs"] for e in ems)
    worst = max(e["worst_lateness_p99_of_step"] for e in ems)
    return [f"**EMULATED** ({profiles}, time scale x{ems[0]['time_scale']:g}; docs/emulation.md): rates and times are "
            f"emulated time (wall-clock / scale), not a measurement of hardware; {valid} of {runs} runs valid "
            f"(worst instance lateness p99 {worst:.1%} of its median step).", ""]


def confirm_table(doc: dict[str, Any]) -> list[str]:
    """Per confirmed cell: auto vs the best fixed mode (and push vs pull) in the screen and pooled."""
    out = ["| cell | runs per mode | auto / best TTFT p50: screen -> pooled | auto / best TTFT p99: screen -> pooled "
           "| push/pull TTFT p50: screen -> pooled |", "|---|---|---|---|---|"]
    for c in doc["cells"]:
        runs = sorted({m["runs"] for m in c["modes"].values()})
        out.append(f"| {c['name']} | {'/'.join(map(str, runs))} | {_screen_and_pooled(c, 'auto_vs_best', 'ttft_p50')} | "
                   f"{_screen_and_pooled(c, 'auto_vs_best', 'ttft_p99')} | {_screen_and_pooled(c, 'push_vs_pull', 'ttft_p50')} |")
    return out


def _screen_and_pooled(c: dict, group: str, key: str) -> str:
    """`screen ratio -> pooled ratio`, and which mode was the best in each where that changed."""
    screen = c.get("screen") or {}
    old, new = _cell_ratio(screen, group, key), _cell_ratio(c, group, key)
    names = [(g.get("best") or "") for g in (screen.get(group) or {}, c.get(group) or {})]
    tag = f" (best: {names[0]} -> {names[1]})" if group == "auto_vs_best" and names[0] != names[1] else ""
    return f"{_ratio_text(old)} -> {_ratio_text(new)}{tag}"


def calibration_lines(doc: dict[str, Any]) -> list[str]:
    """What the process check (bench/calibrate.py) found and restarted, per grid row; nothing if not run."""
    cal = doc.get("calibration") or {}
    if not cal:
        return []
    restarts = [f"{row}: {m} ({why})" for row, rounds in cal.items() for r in rounds
                for m, why in r["slow"].items() if m in r["restarted"]]
    kept = [f"{row}: {m}" for row, rounds in cal.items() for m in (rounds[-1]["slow"] if rounds else {})]
    batched = any(p.get("batch_step_ms") for rounds in cal.values() for r in rounds for p in r["probes"].values())
    step = "decode step (alone or with requests at once)" if batched else "decode step"
    return [f"- **Process check** (every deployment probed before each row; one whose {step} or P's prefill "
            f"ran > {CalibrationConfig.slow_ratio:g}x the median of the others restarted): "
            + ("; ".join(restarts) if restarts else "no restart")
            + (f"; still slow after its restarts, measured as it was: {'; '.join(kept)}" if kept else "") + "."]


def update_doc(doc_path: Path, text: str, grid: str) -> None:
    """Replace the grid's generated section between its markers (appended at the end the first time)."""
    body = doc_path.read_text()
    begin, end = markers(grid)
    if begin in body and end in body:
        head, rest = body.split(begin, 1)
        body = head + text + rest.split(end, 1)[1]
    else:
        body = body.rstrip("\n") + "\n\n" + text + "\n"
    doc_path.write_text(body)


def report(path: Path, doc_path: Path | None = None, image: Path | None = None) -> str:
    """regime_map.md (and PNG) next to the JSON; with `doc_path`, its generated section too (the PNG
    copied to `image`, a path relative to the doc's folder, e.g. ../img/regime_map.png for
    docs/results/regime-map.md)."""
    doc = json.loads(path.read_text())
    name = section_name(doc["config"])
    png = heatmaps(doc, path.parent)
    link = str(png) if png else None
    if png is not None and doc_path is not None and image is not None:
        image = image.with_name(f"regime_map_{name}.png")
        target = doc_path.parent / image
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png.read_bytes())
        link = str(image)
    text = section(doc, link)
    (path.parent / "regime_map.md").write_text(text + "\n")
    if doc_path is not None:
        update_doc(doc_path, text, name)
    return text


def section_name(config: dict) -> str:
    """The README section of a map: its grid, and `-link` for a map of the rate-limited link alone."""
    name = config["grid"] if config.get("full_link", True) else f"{config['grid']}-link"
    name += "".join(f"-{r.replace('/', 'x')}" for r in config.get("rows") or ())  # a map of some rows alone
    name += "".join(f"-{x:.0%}" for x in config.get("loads") or ()) + "".join(f"-{x}" for x in config.get("prefixes") or ())
    name += "-variants" if config.get("auto_variants") else ""  # auto's settings compared: not the map itself
    return f"{name}-confirm" if config.get("confirm_of") else name
