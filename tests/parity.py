"""Helpers of the parity suite: one colocated instance and 1P1D deployments side by side, HTTP calls
that read a whole answer (JSON or SSE), and the normal form in which two answers are compared."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvpush_testing import SERVE, Cluster

from kvpush.launcher.launch import ServerProcess, free_port

MODES = ("pull", "push", "push-layerwise", "auto")
FIRST_TOKENS = ("recompute", "from-prefill")
MAX_MODEL_LEN = 128
# short leases, deadlines and quarantine, so that the leak check at the end need not wait long
LIMITS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-lease-s", "15", "--kv-timeout-s", "15",
          "--kv-quarantine-s", "1")
LOGPROB_TOLERANCE = 1e-4  # fp32; D computes the last prompt position in a batch of another shape


@dataclass
class World:
    colocated: ServerProcess
    clusters: dict[str, Cluster]
    proxies: dict[str, ServerProcess] = field(default_factory=dict)  # "mode/first-token" -> proxy

    @property
    def instances(self) -> list[ServerProcess]:
        return list(self.names())

    def names(self) -> dict[ServerProcess, str]:
        """Every server (not the proxies) and what it is, e.g. "push/prefill"."""
        out = {self.colocated: "colocated"}
        for mode, c in self.clusters.items():
            out |= {p: f"{mode}/prefill" for p in c.prefills} | {d: f"{mode}/decode" for d in c.decodes}
        return out

    def stop(self) -> None:
        """Proxies first, then every server, each group stopped in parallel."""
        servers = [self.colocated, *(p for c in self.clusters.values() for p in c.procs)]
        for group in (list(self.proxies.values()), servers):
            with ThreadPoolExecutor(len(group) or 1) as pool:
                list(pool.map(ServerProcess.stop, group))


def start_world(model: str, log_dir) -> World:
    """Every server starts at once (they load in parallel), then one proxy per mode and first token."""
    port = free_port()
    colocated = ServerProcess(["serve", model, "--port", str(port), *SERVE, "--max-model-len", str(MAX_MODEL_LEN)],
                              log_path=str(log_dir / f"colocated-{port}.log")).start()
    world = World(colocated, {})
    try:
        for mode in MODES:
            world.clusters[mode] = Cluster(model, mode, log_dir, extra_prefill=LIMITS, extra_decode=LIMITS)
        for proc in world.instances:
            proc.wait_healthy(180)
        for mode, c in world.clusters.items():
            for ft in FIRST_TOKENS:
                port = free_port()
                argv = ["proxy", "--port", str(port), "--kv-mode", mode, "--first-token", ft,
                        "--prefill", *[p.url for p in c.prefills], "--decode", *[d.url for d in c.decodes]]
                world.proxies[f"{mode}/{ft}"] = ServerProcess(argv, log_path=str(log_dir / f"proxy-{port}.log")).start()
        for proc in world.proxies.values():
            proc.wait_healthy(120)
    except BaseException:
        world.stop()
        raise
    return world


def call(url: str, path: str, body: object, timeout: float = 60) -> dict:
    """POST and read the whole answer: {"status", "json"} or, for SSE, {"status", "events"} where events
    are the decoded `data:` payloads and "[DONE]"."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if r.headers.get_content_type() != "text/event-stream":
                return {"status": r.status, "json": json.loads(r.read())}
            events: list = []
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    payload = line[6:]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
            return {"status": r.status, "events": events}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "json": json.loads(e.read())}


# ---- normal form -------------------------------------------------------------------------------
VOLATILE = ("id", "created", "kvpush_trace", "kvpush_prompt", "kvpush_route", "kv_transfer_params")


def _strip(obj: object) -> object:
    """Drop what legitimately differs between two deployments: ids, timestamps, kvpush's own fields,
    and usage's cached_tokens (which depends on what the instance's prefix cache held)."""
    if isinstance(obj, dict):
        out = {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
        if isinstance(out.get("prompt_tokens_details"), dict):
            details = dict(out["prompt_tokens_details"])  # type: ignore[arg-type]
            assert isinstance(details.pop("cached_tokens", 0), int)
            out["prompt_tokens_details"] = details
        return out
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def normal(answer: dict) -> dict:
    """Errors: status, type and param (messages may word the same mistake differently). JSON: the body
    without volatile fields. SSE: per choice index, its chunks in order; the usage chunks; the framing
    (which must end with one usage chunk when asked, then one [DONE])."""
    if answer["status"] != 200:
        err = answer["json"].get("error", {})
        assert isinstance(err.get("message"), str) and err["message"], answer
        return {"status": answer["status"], "type": err.get("type"), "param": err.get("param")}
    if "json" in answer:
        return {"status": 200, "json": _strip(answer["json"])}
    per_choice: dict[int, list] = {}
    usage, framing = [], []
    for ev in answer["events"]:
        if ev == "[DONE]":
            framing.append("done")
        elif "error" in ev:
            framing.append(("error", ev["error"].get("type")))
        elif ev.get("choices") == [] and ev.get("usage") is not None:
            framing.append("usage")
            usage.append(_strip(ev))
        else:
            framing.append("chunk")
            assert len(ev["choices"]) == 1, ev
            assert ev["usage"] is None, ev
            choice = ev["choices"][0]
            per_choice.setdefault(choice["index"], []).append(_strip({**ev, "choices": None, "choice": choice}))
    ids = {ev["id"] for ev in answer["events"] if isinstance(ev, dict) and "id" in ev}
    assert len(ids) == 1, f"one id per answer, got {ids}"
    collapsed = [f for i, f in enumerate(framing) if f != "chunk" or i == 0 or framing[i - 1] != "chunk"]
    return {"status": 200, "choices": per_choice, "usage": usage, "framing": collapsed}


def assert_same(colocated: object, disagg: object, where: str = "$") -> None:
    """Equal, except floats (logprobs) within LOGPROB_TOLERANCE; NaN never equals a number."""
    if isinstance(colocated, float) or isinstance(disagg, float):
        assert isinstance(disagg, (int, float)) and isinstance(colocated, (int, float)), where
        assert not math.isnan(disagg) and math.isclose(colocated, disagg, rel_tol=0, abs_tol=LOGPROB_TOLERANCE), \
            f"{where}: {colocated} != {disagg}"
    elif isinstance(colocated, dict) and isinstance(disagg, dict):
        assert colocated.keys() == disagg.keys(), f"{where}: keys {sorted(colocated)} != {sorted(disagg)}"
        for k in colocated:
            assert_same(colocated[k], disagg[k], f"{where}.{k}")
    elif isinstance(colocated, list) and isinstance(disagg, list):
        assert len(colocated) == len(disagg), f"{where}: {len(colocated)} items != {len(disagg)}: {colocated} {disagg}"
        for i, (a, b) in enumerate(zip(colocated, disagg, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert colocated == disagg, f"{where}: {colocated!r} != {disagg!r}"
