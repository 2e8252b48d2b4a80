"""The prefill side (P) of a disaggregated deployment.

Request lifecycle on P:
    admitted (kv_transfer_params = PrefillLegParams; max_tokens forced to 1; push: Expect sent)
    -> prefill computed, first token sampled -> FINISHED: blocks *held* (Hold sent to the transfer
       thread) and PrefillResult returned to the proxy (pull: P's block ids and lease)
    -> transfer DONE (push: WRITE done; pull: D's ReadDone; either: D's Release)
       or FAILED / EXPIRED (lease) -> FreeBlocks event -> blocks back to the block manager.
A request that ends without a prefill (aborted) frees its blocks at once and tells D (Cancel).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvpush.config import KVMode, TransferConfig
from kvpush.engine.request import Request, RequestStatus
from kvpush.errors import InvalidRequestError
from kvpush.transfer import protocol as pr
from kvpush.transfer.commands import Cancel, Expect, FreeBlocks, Hold, LayersDone
from kvpush.transfer.runtime import RuntimeConnector, TransferRuntime


@dataclass
class PrefillState:
    params: pr.PrefillLegParams
    handed: int = 0  # layer-wise: blocks [0, handed) were handed to the writer (every layer)


def parse_params(kv: dict | None, cls, mode: KVMode, role: str):
    """kv_transfer_params of one leg, checked against this instance's mode. InvalidRequestError if bad."""
    if kv is None:
        raise InvalidRequestError(f"a {role} instance needs kv_transfer_params from the proxy",
                                  param="kv_transfer_params")
    try:
        params = pr.params_from_dict(kv, cls)
    except pr.ProtocolError as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e
    if params.mode is not mode:
        raise InvalidRequestError(f"kv_transfer_params mode {params.mode.value!r} but this instance runs "
                                  f"--kv-mode {mode.value}", param="kv_transfer_params")
    return params


class PrefillConnector(RuntimeConnector):
    def __init__(self, runtime: TransferRuntime, config: TransferConfig) -> None:
        super().__init__(runtime, config)
        self.host, port = runtime.kv_address.rsplit(":", 1)
        self.port = int(port)

    def on_add(self, request: Request, kv_transfer_params: dict | None) -> None:
        params = parse_params(kv_transfer_params, pr.PrefillLegParams, self.runtime.mode, "prefill")
        # One token; min_tokens capped at 1 so that its sample masks stop tokens as D's or a colocated one would
        sp = request.sampling_params
        request.sampling_params = msgspec.structs.replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1))
        request.kv_state = PrefillState(params)
        if params.mode.is_push:
            self.runtime.worker.submit(Expect(params.transfer_id))

    def before_forward(self, scheduled: list[tuple[Request, int]]) -> None:
        """Layer-wise push: after each layer, hand the writer the blocks this chunk completes (the last
        chunk also its partial last block). What was handed over is never handed again."""
        if self.runtime.mode is not KVMode.PUSH_LAYERWISE:
            return
        bs = self.engine.block_manager.block_size
        items = []
        for request, n in scheduled:
            st = request.kv_state
            if not isinstance(st, PrefillState):
                continue
            end = request.num_computed_tokens + n
            last = -(-end // bs) if end >= request.num_prompt_tokens else end // bs
            if last > st.handed:
                indices = tuple(range(st.handed, last))
                items.append((st.params.transfer_id, indices, tuple(request.block_table[i] for i in indices)))
                st.handed = last
        submit, batch = self.runtime.worker.submit, tuple(items)
        self.engine.runner.layer_hook = (lambda layer: submit(LayersDone(layer, batch))) if batch else None

    def admit(self, request: Request) -> bool:
        delay = self.config.faults.delay_prefill_s
        return delay <= 0 or time.time() >= request.trace.get("arrived", 0.0) + delay

    def on_finished(self, request: Request) -> bool:
        st = request.kv_state
        if not isinstance(st, PrefillState):
            return False
        p = st.params
        if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) \
                or not request.output_token_ids:
            self.runtime.worker.submit(Cancel(p.transfer_id, f"prefill {request.status.value}", p.decode_engine_id))
            return False
        blocks = tuple(request.block_table)
        request.block_table = []
        now = time.time()
        lease = now + self.config.kv_lease_s
        first = request.output_token_ids[0]
        self.runtime.worker.submit(Hold(p.transfer_id, request.request_id, blocks, request.num_prompt_tokens,
                                        first, lease, p.decode_engine_id))
        pull = p.mode is KVMode.PULL
        result = pr.PrefillResult(
            transfer_id=p.transfer_id, mode=p.mode, prefill_engine_id=self.engine_id, prefill_kv_host=self.host,
            prefill_kv_port=self.port, num_tokens=request.num_prompt_tokens,
            block_ids=list(blocks) if pull else [], lease_expiry=lease if pull else None, first_token_id=first)
        request.kv_result = pr.params_to_dict(result)
        request.trace["prefill_done"] = now
        return True

    def poll(self) -> list[Request]:
        for event in self.runtime.drain_events():
            if isinstance(event, FreeBlocks):
                self.engine.block_manager.free_blocks(event.block_ids)
        return []

