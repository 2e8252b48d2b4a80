"""`kvpush env` and the machine facts every benchmark run records (kvpush/bench/machine.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvpush.bench import machine
from kvpush.cli import main

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
stepping\t: 1
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 sha_ni

processor\t: 1
model name\t: another CPU the first one stands for
"""
NEOVERSE = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def test_cpu_facts_from_cpuinfo(tmp_path: Path):
    (tmp_path / "x86").write_text(ZEN4)
    c = machine.cpu(tmp_path / "x86")
    assert c["model"] == "AMD EPYC 9R14 96-Core Processor" and (c["family"], c["model_number"]) == ("25", "17")
    assert c["vector_flags"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"]
    (tmp_path / "arm").write_text(NEOVERSE)
    arm = machine.cpu(tmp_path / "arm")
    assert arm["vector_flags"] == ["asimd", "sve"] and arm["family"] == "" and arm["model"]  # the arch, at least
    assert machine.cpu(tmp_path / "missing")["model"]


def test_huge_pages_mode(tmp_path: Path):
    (tmp_path / "thp").write_text("always [madvise] never\n")
    assert machine.huge_pages(tmp_path / "thp") == "madvise"
    assert machine.huge_pages(tmp_path / "none") == "unknown"


def test_facts_of_this_machine():
    f = machine.facts()
    assert f["cores_usable"] == len(os.sched_getaffinity(0)) and f["cores_online"] == os.cpu_count()
    assert f["software"]["torch"] == torch.__version__ and f["software"]["ucx_tls"]
    assert f["kernels"]["decode_attention"].endswith(("C kernel available: paged_decode (-march=native)",
                                                       "no C kernel: gather + SDPA"))
    assert machine.cpu_label(f).startswith(f["cpu"]["model"])
    json.dumps(f)  # recorded in every run's JSON as it is


def test_kvpush_env_prints_the_facts(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("CPU") and "decode attention" in text and "transparent huge pages" in text
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == machine.facts()
