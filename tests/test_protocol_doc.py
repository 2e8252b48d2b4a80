"""docs/protocol.md states what a deployer relies on; these facts are checked against the code.

The "Deployer facts" table at the top of the page is parsed; each row is compared with the
defaults in kvpush/config.py or with what the code does.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import re

import pytest

from kvpush.config import ProxyConfig, Role, ServerConfig, TransferConfig
from kvpush.transfer import protocol as pr
from kvpush.transfer.handshake import compat_summary
from kvpush.transfer.ledger import TransferLedger
from kvpush.transfer.records import TransferState
from kvpush.transfer.runtime import model_identity
from kvpush.transfer.thread import TransferThread

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


@pytest.fixture(scope="module")
def facts() -> dict[str, str]:
    text = DOC.read_text()
    table = text.split("**Deployer facts**", 1)[1].split("\n\n", 2)[1]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return {key.strip(): value.strip() for key, value in rows}


def _row(facts: dict[str, str], starts: str) -> str:
    (value,) = [v for k, v in facts.items() if k.startswith(starts)]
    return value


def _seconds(value: str) -> float:
    match = re.search(r"([0-9.]+) s\b", value)
    assert match, value
    return float(match.group(1))


def test_first_token_default(facts: dict[str, str]) -> None:
    assert _row(facts, "first token") == f"default `{ProxyConfig().first_token.value}`"


@pytest.mark.parametrize("starts, field", [("P's lease", "kv_lease_s"), ("D's deadline", "kv_timeout_s"),
                                           ("D's quarantine", "kv_quarantine_s")])
def test_transfer_defaults(facts: dict[str, str], starts: str, field: str) -> None:
    value = _row(facts, starts)
    assert f"--{field.replace('_', '-')}" in [k for k in facts if k.startswith(starts)][0]
    assert _seconds(value) == getattr(TransferConfig(), field)


def test_writes_per_peer_default(facts: dict[str, str]) -> None:
    assert "--kv-writes-per-peer" in [k for k in facts if k.startswith("P's whole-request WRITEs")][0]
    assert _row(facts, "P's whole-request WRITEs") == f"default {TransferConfig().kv_writes_per_peer}"


def test_shutdown_timeout_default(facts: dict[str, str]) -> None:
    assert "--shutdown-timeout" in [k for k in facts if k.startswith("drain after SIGTERM")][0]
    assert _seconds(_row(facts, "drain after SIGTERM")) == ServerConfig().shutdown_timeout_s


def test_handshake_timeout(facts: dict[str, str]) -> None:
    default = inspect.signature(TransferThread.__init__).parameters["handshake_timeout_s"].default
    assert _seconds(_row(facts, "handshake timeout")) == default


def test_decode_renews_and_prefill_accepts(facts: dict[str, str]) -> None:
    assert _row(facts, "who renews").startswith("D,")
    src = pathlib.Path(inspect.getfile(TransferThread)).parent
    senders = [f.name for f in src.glob("*.py") if "pr.LeaseRenew(" in f.read_text()]
    assert senders == ["decode_connector.py"]
    p = TransferLedger(Role.PREFILL, clock=lambda: 100.0)
    p.on_prefill_done("t", "r", [1], lease_deadline=110.0)
    renewed = p.on_notification(pr.LeaseRenew("t", 150.0), "decode-0")
    assert renewed is not None and renewed.state is TransferState.PREFILLED and renewed.deadline == 150.0
    assert TransferLedger(Role.DECODE).on_notification(pr.LeaseRenew("t", 150.0), "prefill-0") is None


def test_compat_hash_inputs(facts: dict[str, str], tmp_path: pathlib.Path) -> None:
    without_notes = re.sub(r"\s*\([^)]*\)", "", _row(facts, "compatibility hash"))
    documented = [name.strip() for name in without_notes.split(",")]
    summary = compat_summary("m", "torch.float32", 2, 2, 8, 16, "push")
    assert documented == [field.split("=")[0] for field in summary.split()]
    # "model" is the checkpoint's config.json, not its path
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 8}))
    assert model_identity(str(tmp_path / "a")) == model_identity(str(tmp_path / "b"))
    (tmp_path / "b" / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 16}))
    assert model_identity(str(tmp_path / "a")) != model_identity(str(tmp_path / "b"))


def test_no_stale_claims() -> None:
    text = DOC.read_text()
    for stale in ("D does not send", "D neither checks", "TransferConfig.first_token`", "sends no `Authorization`",
                  "`recompute` (default)", "TransferWorker", "`Expect`"):
        assert stale not in text, stale


@pytest.mark.parametrize("starts, field", [("requests waiting beyond", "max_waiting"),
                                           ("prompt tokens waiting", "max_waiting_tokens"),
                                           ("KV cache kept free", "kv_headroom"),
                                           ("Retry-After", "retry_after_s")])
def test_admission_defaults(facts: dict[str, str], starts: str, field: str) -> None:
    from kvpush.config import AdmissionConfig

    key = [k for k in facts if k.startswith(starts)][0]
    assert f"--{field.removesuffix('_s').replace('_', '-')}" in key
    value = re.search(r"default ([0-9.]+)", _row(facts, starts))
    assert value and float(value.group(1)) == getattr(AdmissionConfig(), field)


def _table_rows(section: str) -> dict[str, str]:
    """First-column name (without backticks) -> the whole row, for every table row of the section."""
    text = DOC.read_text().split(section, 1)[1]
    text = text.split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            for name in re.findall(r"`([A-Za-z_]+)`", first):
                rows[name] = line
    return rows


def _fields(struct: type) -> set[str]:
    return set(struct.__struct_fields__)


def test_the_leg_parameter_table_lists_every_field():
    from kvpush.protocol import kv_params as kp

    rows = _table_rows("### 3.1 HTTP leg parameters")
    for struct in (kp.PrefillLegParams, kp.PrefillResult, kp.DecodeLegParams):
        row = rows[struct.__name__]
        missing = {f for f in _fields(struct) if f"`{f}`" not in row}
        assert not missing, f"docs/protocol.md 3.1, {struct.__name__}: {sorted(missing)} not listed"


def test_the_notification_table_lists_every_message_and_field():
    rows = _table_rows("### 3.2 KV-channel notifications")
    assert set(rows) >= {m.__name__ for m in pr.MESSAGE_TYPES}
    for message in pr.MESSAGE_TYPES:
        row = rows[message.__name__]
        missing = {f for f in _fields(message) if f"`{f}`" not in row and f"`{f}?`" not in row}
        assert not missing, f"docs/protocol.md 3.2, {message.__name__}: {sorted(missing)} not listed"


def test_the_kv_info_example_has_every_field():
    from kvpush.protocol.kv_params import KVInfo

    text = DOC.read_text().split("### 3.4", 1)[1]
    example = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    assert set(example) == _fields(KVInfo)


def test_the_trace_table_lists_every_stamp_an_instance_or_the_proxy_sets():
    from kvpush.protocol.trace import Trace

    text = DOC.read_text().split("**`kvpush_trace`.**", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in text.splitlines()[2:])))
    client = {"client_sent", "client_first_chunk"}  # the load generator's own, named below the table
    assert _fields(Trace) - client <= listed, sorted(_fields(Trace) - client - listed)
    assert listed <= _fields(Trace), sorted(listed - _fields(Trace))
