"""KV-channel messages, leg parameters and the handshake: wire format and every rejection path."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import FirstToken, KVMode, Role
from kvpush.errors import HandshakeError, ProtocolError, TransferError
from kvpush.protocol import kv_params as kp
from kvpush.protocol.kv_params import PROTOCOL_VERSION, DecodeLegParams, PrefillLegParams, PrefillResult
from kvpush.transfer import handshake as hs
from kvpush.transfer import protocol as pr
from kvpush.transfer.protocol import (
    MAX_MESSAGE_BYTES,
    Abort,
    Commit,
    Done,
    Fail,
    LeaseRenew,
    PushReg,
    ReadDone,
    Release,
    decode,
    encode,
)

TID = pr.new_transfer_id()
MESSAGES = [
    PushReg(TID, "decode-0", [3, 4, 5], 16, 40, 1.7e9),
    PushReg(TID, "decode-0", [0], 0, 1, 0.0),
    Done(TID, 1234),
    Done(TID),
    Fail(TID, "WRITE failed: remote disconnected"),
    Abort(TID),
    Release(TID),
    LeaseRenew(TID, 1.7e9 + 30),
    ReadDone(TID),
    Commit(TID),
]


# --- KV-channel messages --------------------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: pr.Message) -> None:
    data = encode(msg)
    assert data[0] == PROTOCOL_VERSION
    assert len(data) <= MAX_MESSAGE_BYTES
    out = decode(data)
    assert type(out) is type(msg)
    assert out == msg


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(pr.MESSAGE_TYPES)


def test_protocol_error_is_a_transfer_error() -> None:
    assert issubclass(ProtocolError, TransferError)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 255])
def test_version_mismatch_names_both_versions(version: int) -> None:
    data = bytes([version]) + encode(Done(TID))[1:]
    with pytest.raises(ProtocolError) as exc:
        decode(data)
    text = str(exc.value)
    assert f"version {version}" in text and f"version {PROTOCOL_VERSION}" in text


def test_oversized_message_rejected_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="more than"):
        decode(bytes([PROTOCOL_VERSION]) + b"\x00" * MAX_MESSAGE_BYTES)


def test_oversized_message_refused_by_encode() -> None:
    big = PushReg(TID, "d", list(range(2**31, 2**31 + MAX_MESSAGE_BYTES // 4)), 0, 1, 1.0)
    with pytest.raises(ProtocolError, match="more than"):
        encode(big)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_a_protocol_error(msg: pr.Message) -> None:
    data = encode(msg)
    for n in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:n])


def test_trailing_garbage_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode(encode(Abort(TID)) + b"\x00")


@pytest.mark.parametrize("obj", [
    ["PushReg", TID, "d", [1], 5, 4, 1.0],  # prefix longer than the request
    ["PushReg", TID, "d", [-1], 0, 4, 1.0],  # negative block id
    ["PushReg", TID, "d", [], 0, 4, 1.0],  # no blocks
    ["PushReg", TID, "d", [1], 0, 4, float("nan")],  # deadline not finite
    ["Done", "bad id with spaces"],
    ["Done", ""],
    ["Done", "x" * 129],
    ["Fail", TID, "r" * (pr.MAX_REASON_CHARS + 1)],
    ["LeaseRenew", TID, float("inf")],
    ["Nope", TID],
    ["Done"],
    {"type": "Done", "transfer_id": TID},  # messages are arrays, not maps
    [1, 2, 3],
    "Done",
])
def test_invalid_contents_are_protocol_errors(obj: object) -> None:
    with pytest.raises(ProtocolError):
        decode(bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(obj))


@pytest.mark.parametrize("data", [b"", b"\x01", "not bytes", None, 12])
def test_degenerate_inputs(data: object) -> None:
    with pytest.raises(ProtocolError):
        decode(data)  # type: ignore[arg-type]


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(ProtocolError):
        encode(PrefillLegParams(transfer_id=TID, mode=KVMode.PULL))  # type: ignore[arg-type]


def test_fail_create_truncates_reason() -> None:
    msg = Fail.create(TID, "x" * 10_000)
    assert len(msg.reason) == pr.MAX_REASON_CHARS
    assert decode(encode(msg)) == msg


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        out = decode(data)
    except ProtocolError:
        return
    assert isinstance(out, pr.MESSAGE_TYPES)


_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
         | st.text(max_size=20) | st.binary(max_size=20)
         | st.sampled_from([t.__name__ for t in pr.MESSAGE_TYPES]) | st.just(TID))
_msgpack_values = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([t.__name__ for t in pr.MESSAGE_TYPES]), st.lists(_msgpack_values, max_size=7))
def test_fuzz_well_formed_msgpack_only_raises_protocol_error(tag: str, fields: list[object]) -> None:
    data = bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode([tag, *fields])
    try:
        out = decode(data)
    except ProtocolError:
        return
    assert isinstance(out, pr.MESSAGE_TYPES)
    assert decode(encode(out)) == out


def test_transfer_ids_are_unique_and_valid() -> None:
    ids = {pr.new_transfer_id() for _ in range(20_000)}
    assert len(ids) == 20_000
    for tid in list(ids)[:100]:
        assert decode(encode(Abort(tid))) == Abort(tid)


# --- leg parameters --------------------------------------------------------------------------


def _result(mode: KVMode = KVMode.PULL) -> PrefillResult:
    pull = mode is KVMode.PULL
    return PrefillResult(transfer_id=TID, mode=mode, prefill_engine_id="prefill-0", prefill_kv_host="10.0.0.1",
                         prefill_kv_port=5600, num_tokens=40, block_ids=[7, 8, 9] if pull else [],
                         lease_expiry=1.7e9 if pull else None, first_token_id=42)


@pytest.mark.parametrize("params", [
    PrefillLegParams(transfer_id=TID, mode=KVMode.PULL),
    PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH, decode_engine_id="decode-0"),
    _result(KVMode.PULL),
    _result(KVMode.PUSH),
    _result().to_decode_leg(FirstToken.FROM_PREFILL),
    DecodeLegParams(transfer_id=TID, mode=KVMode.PUSH, prefill_engine_id="prefill-0",
                    prefill_kv_host="h", prefill_kv_port=1),
], ids=lambda p: f"{type(p).__name__}-{p.mode.value}")
def test_params_round_trip_through_json(params: pr.LegParams) -> None:
    as_json = msgspec.json.encode(kp.params_to_dict(params))
    data = msgspec.json.decode(as_json)
    assert data["type"] == type(params).__name__
    assert data["protocol_version"] == PROTOCOL_VERSION
    assert kp.params_from_dict(data, type(params)) == params


def test_to_decode_leg_carries_pull_fields() -> None:
    leg = _result().to_decode_leg(FirstToken.FROM_PREFILL)
    assert (leg.block_ids, leg.num_tokens, leg.lease_expiry, leg.first_token_id) == ([7, 8, 9], 40, 1.7e9, 42)
    assert leg.first_token is FirstToken.FROM_PREFILL and leg.do_remote_prefill


def test_params_version_mismatch_names_both() -> None:
    data = kp.params_to_dict(_result())
    data["protocol_version"] = 99
    with pytest.raises(ProtocolError, match=rf"99.*{PROTOCOL_VERSION}"):
        kp.params_from_dict(data, PrefillResult)


@pytest.mark.parametrize("change", [
    {"block_ids": []}, {"lease_expiry": None}, {"prefill_kv_port": 0}, {"num_tokens": 0},
    {"transfer_id": "a b"}, {"mode": "sideways"}, {"type": "DecodeLegParams"}, {"block_ids": "1,2"},
])
def test_invalid_params_are_protocol_errors(change: dict[str, object]) -> None:
    data = kp.params_to_dict(_result())
    data.update(change)
    with pytest.raises(ProtocolError):
        kp.params_from_dict(data, PrefillResult)


@pytest.mark.parametrize("data", [None, [], "x", {"type": "PrefillLegParams"}])
def test_params_garbage(data: object) -> None:
    with pytest.raises(ProtocolError):
        kp.params_from_dict(data, PrefillLegParams)


def test_push_prefill_leg_may_leave_the_decode_engine_open() -> None:
    # routers built for vLLM do not know D's engine id: P then accepts the first D that registers
    assert PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH).decode_engine_id is None
    with pytest.raises(ProtocolError):
        PrefillLegParams(transfer_id=TID, mode=KVMode.PUSH, decode_engine_id="")


def test_pull_decode_leg_from_prefill_needs_first_token() -> None:
    with pytest.raises(ProtocolError):
        DecodeLegParams(transfer_id=TID, mode=KVMode.PULL, prefill_engine_id="p", prefill_kv_host="h",
                        prefill_kv_port=1, block_ids=[1], num_tokens=3, lease_expiry=1.0,
                        first_token=FirstToken.FROM_PREFILL)


# --- handshake -------------------------------------------------------------------------------

COMPAT: dict[str, Any] = dict(model_id="Qwen/Qwen3-0.6B", dtype="bfloat16", num_layers=28, num_kv_heads=8, head_dim=128,
              block_size=16, kv_mode=KVMode.PUSH)
HASH = hs.compat_hash(**COMPAT)  # type: ignore[arg-type]


def _info(**changes: object) -> hs.HandshakeInfo:
    fields: dict[str, object] = dict(
        engine_id="prefill-0", role=Role.PREFILL, agent_name="agent-prefill-0", agent_metadata=b"\x00meta" * 100,
        base_address=0x7F00_0000_0000, num_blocks=1024, num_layers=28, block_bytes=28 * 65536,
        layer_bytes=65536, memory_type="DRAM", compat_hash=HASH, compat_summary=hs.compat_summary(**COMPAT))
    fields.update(changes)
    return hs.HandshakeInfo(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_handshake_good_path(secret: str | None) -> None:
    info = _info()
    assert hs.verify_and_decode(hs.pack(info, secret), secret, HASH) == info
    assert hs.verify_and_decode(hs.sign(hs.encode_info(info), secret), secret, HASH,
                                expected_engine_id="prefill-0") == info


def test_handshake_wrong_secret() -> None:
    with pytest.raises(HandshakeError, match="signature is invalid"):
        hs.verify_and_decode(hs.pack(_info(), "one"), "two", HASH)


def test_handshake_unsigned_rejected_by_peer_with_secret() -> None:
    with pytest.raises(HandshakeError, match="unsigned.*secrets differ"):
        hs.verify_and_decode(hs.pack(_info(), None), "s3cret", HASH)


def test_handshake_signed_rejected_by_peer_without_secret() -> None:
    with pytest.raises(HandshakeError, match="signed but this instance has no --kv-secret"):
        hs.verify_and_decode(hs.pack(_info(), "s3cret"), None, HASH)


def test_handshake_tampered_payload() -> None:
    env = msgspec.msgpack.decode(hs.pack(_info(), "s3cret"))
    env[1] = hs.encode_info(_info(base_address=0))
    with pytest.raises(HandshakeError, match="signature is invalid"):
        hs.verify_and_decode(msgspec.msgpack.encode(env), "s3cret", HASH)


def test_handshake_compat_mismatch_names_both() -> None:
    other = hs.compat_hash(**{**COMPAT, "block_size": 32})  # type: ignore[arg-type]
    with pytest.raises(HandshakeError) as exc:
        hs.verify_and_decode(hs.pack(_info(), None), None, other,
                             expected_compat_summary="block_size=32")
    text = str(exc.value)
    assert HASH in text and other in text and "block_size=16" in text and "block_size=32" in text


@pytest.mark.parametrize("field", ["model_id", "dtype", "num_layers", "num_kv_heads", "head_dim",
                                   "block_size", "kv_mode"])
def test_compat_hash_covers_every_field(field: str) -> None:
    changed = {**COMPAT, field: KVMode.PULL if field == "kv_mode" else (
        COMPAT[field] + 1 if isinstance(COMPAT[field], int) else f"{COMPAT[field]}x")}
    assert hs.compat_hash(**changed) != HASH  # type: ignore[arg-type]
    assert hs.compat_hash(**COMPAT) == HASH  # type: ignore[arg-type]
    assert hs.compat_hash(**{**COMPAT, "kv_mode": "push"}) == HASH  # type: ignore[arg-type]


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_handshake_version_mismatch_names_both(secret: str | None) -> None:
    env = msgspec.msgpack.decode(hs.pack(_info(), secret))
    env[0] = PROTOCOL_VERSION + 6
    with pytest.raises(HandshakeError) as exc:
        hs.verify_and_decode(msgspec.msgpack.encode(env), secret, HASH)
    text = str(exc.value)
    assert f"version {PROTOCOL_VERSION + 6}" in text and f"version {PROTOCOL_VERSION}" in text


def test_handshake_payload_version_mismatch() -> None:
    with pytest.raises(HandshakeError, match="version"):
        hs.verify_and_decode(hs.pack(_info(protocol_version=PROTOCOL_VERSION + 1), None), None, HASH)


@pytest.mark.parametrize("changes", [
    {"block_bytes": 12345}, {"memory_type": "TAPE"}, {"num_blocks": 0}, {"engine_id": ""},
    {"base_address": -1}, {"layer_bytes": 0, "block_bytes": 0},
])
def test_handshake_inconsistent_geometry(changes: dict[str, object]) -> None:
    with pytest.raises(HandshakeError, match="malformed"):
        hs.verify_and_decode(hs.pack(_info(**changes), None), None, HASH)


def test_handshake_unexpected_engine() -> None:
    with pytest.raises(HandshakeError, match="expected 'prefill-1'"):
        hs.verify_and_decode(hs.pack(_info(), None), None, HASH, expected_engine_id="prefill-1")


def test_handshake_oversized() -> None:
    with pytest.raises(HandshakeError, match="more than"):
        hs.verify_and_decode(b"\x00" * (hs.MAX_HANDSHAKE_BYTES + 1), None, HASH)
    with pytest.raises(HandshakeError, match="more than"):
        hs.pack(_info(agent_metadata=b"x" * hs.MAX_HANDSHAKE_BYTES), None)


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_handshake_truncations(secret: str | None) -> None:
    data = hs.pack(_info(agent_metadata=b"m"), secret)
    for n in range(len(data)):
        with pytest.raises(HandshakeError):
            hs.verify_and_decode(data[:n], secret, HASH)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=256), st.sampled_from([None, "s3cret"]))
def test_fuzz_handshake_only_raises_handshake_error(data: bytes, secret: str | None) -> None:
    with pytest.raises(HandshakeError):
        hs.verify_and_decode(data, secret, HASH)


@settings(max_examples=500, deadline=None)
@given(st.lists(_msgpack_values, max_size=4), st.binary(max_size=64))
def test_fuzz_handshake_payload_only_raises_handshake_error(payload: list[object], mac: bytes) -> None:
    for body in (msgspec.msgpack.encode(payload), msgspec.msgpack.encode({"engine_id": payload})):
        data = msgspec.msgpack.encode([PROTOCOL_VERSION, body, None])
        with pytest.raises(HandshakeError):
            hs.verify_and_decode(data, None, HASH)
