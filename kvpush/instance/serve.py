"""`kvpush serve`: start the engine-core process, then the HTTP front end; drain and stop on a signal.

    STARTING (engine core loads the model) -> SERVING (HTTP up, "ready" line printed)
    -> DRAINING (SIGINT/SIGTERM: drain.py, at most --shutdown-timeout; a second signal cuts it short)
    -> STOPPING (HTTP closed, core told to shut down: live transfers fail, peers told; joined or killed)
    -> exit 0
"""

from __future__ import annotations

import asyncio
import logging

from kvpush.config import EngineConfig, ServerConfig, TransferConfig
from kvpush.instance.api import OpenAIServer
from kvpush.instance.engine_client import EngineClient
from kvpush.launcher.placement import apply_cpus, format_cpus
from kvpush.models.tokenizer import Tokenizer
from kvpush.protocol.http import signal_events, start_http

log = logging.getLogger("kvpush.serve")


async def serve(engine_config: EngineConfig, server_config: ServerConfig,
                transfer_config: TransferConfig | None = None) -> None:
    tokenizer = Tokenizer.from_pretrained(engine_config.model.model)
    engine = EngineClient(engine_config)
    await engine.start(extra_args=(server_config.role, transfer_config or TransferConfig(), server_config.admission))
    server = OpenAIServer(server_config, engine, tokenizer, engine_config.model.model)
    try:
        runner = await start_http(server.build_app(), server_config.host, server_config.port, shutdown_timeout_s=2.0)
    except OSError as e:  # e.g. the port is taken: stop the engine core, or exit would wait for it
        await engine.shutdown()
        raise SystemExit(f"kvpush: cannot listen on {server_config.host}:{server_config.port}: "
                         f"{e.strerror or e}") from e
    where = f" on cpus {format_cpus(server_config.cpus)}" if server_config.cpus else ""
    print(f"kvpush: serving {server.model_name} ({server_config.role.value}) on "
          f"http://{server_config.host}:{server_config.port}{where}", flush=True)
    first, second = signal_events()
    try:
        await first.wait()
        await server.drain.run(second)
    finally:
        await runner.cleanup()
        await engine.shutdown()


def run_serve(engine_config: EngineConfig, server_config: ServerConfig,
              transfer_config: TransferConfig | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    apply_cpus(server_config.cpus)  # before any thread or the engine core starts: they inherit it
    asyncio.run(serve(engine_config, server_config, transfer_config))
