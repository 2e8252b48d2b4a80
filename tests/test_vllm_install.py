"""docs/vllm-connector.md's install command, run with the vLLM peer's own pip: `pip install --no-deps`
into a vLLM environment installs kvpush and nothing else (vLLM, torch and nixl stay as they are), and
the connector then loads there from the installed copy, not from a checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from vllm_peer import PEER, ROOT, vllm_binary


def peer_python() -> str:
    vllm_binary()  # skips (fails in CI) without the peer
    return str(PEER / "venv" / "bin" / "python")


def source_copy(dst: Path) -> Path:
    """What pip builds from, copied so that the build writes nothing into the checkout."""
    shutil.copytree(ROOT / "kvpush", dst / "kvpush", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    return dst


def pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([peer_python(), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


def test_install_no_deps_would_add_kvpush_only(tmp_path):
    src = source_copy(tmp_path / "src")
    report = tmp_path / "report.json"
    out = pip("--dry-run", "--report", str(report), str(src))
    assert out.returncode == 0, out.stderr
    names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert names == ["kvpush"]


def test_installed_copy_holds_kvpush_only_and_loads_the_connector(tmp_path):
    python = peer_python()
    target = tmp_path / "site"
    out = pip("--target", str(target), str(source_copy(tmp_path / "src")))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name.split("-")[0] for p in target.iterdir() if p.name != "bin") == ["kvpush", "kvpush"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    probe = ("import kvpush.vllm_connector as c, vllm, torch, nixl; "
             "print(c.__file__); print(c.KVPushConnector.__mro__[1].__name__)")
    loaded = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path, check=False)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    path, base = loaded.stdout.strip().splitlines()[-2:]
    assert path.startswith(str(target)) and base == "KVConnectorBase_V1"
