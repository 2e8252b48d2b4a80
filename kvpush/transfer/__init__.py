"""Moving KV between a prefill and a decode instance: the connectors the engine calls, the transfer
thread that owns every NIXL call, and what they say to each other.

    prefill_connector.py, decode_connector.py  P's and D's KVConnector (engine/kv_connector.py)
    runtime.py          the connector's side of the transfer thread: commands in, events out, wake-ups
    thread.py           the transfer thread's loop; prefill_side.py / decode_side.py: each role's work;
                        peers.py (handshaken peers), posted.py (transfers in flight), layerwise.py
    ledger.py, records.py  one record per transfer and its states (docs/protocol.md section 4)
    protocol.py         the KV-channel messages; handshake.py + side_channel.py: pairing two instances
    kv_agent.py         the agent interface and its core; nixl_agent.py (the one nixl import); fake.py
    descriptors.py      block ids -> byte ranges of the KV buffer; doorbell.py: wake-ups; stats.py: metrics
"""
