"""`kvpush serve`: start the engine-core process, then the HTTP front end; stop both on a signal.

    STARTING (engine core loads the model) -> SERVING (HTTP up, "ready" line printed)
    -> STOPPING (SIGINT/SIGTERM: HTTP closed, core told to shut down, joined or killed) -> exit
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from kvpush.config import EngineConfig, ServerConfig, TransferConfig
from kvpush.placement import apply_cpus, format_cpus
from kvpush.server.api import OpenAIServer
from kvpush.server.engine_client import EngineClient
from kvpush.tokenizer import Tokenizer

log = logging.getLogger("kvpush.serve")


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def wait_for_signal() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(engine_config: EngineConfig, server_config: ServerConfig,
                transfer_config: TransferConfig | None = None) -> None:
    tokenizer = Tokenizer.from_pretrained(engine_config.model.model)
    engine = EngineClient(engine_config)
    await engine.start(extra_args=(server_config.role, transfer_config or TransferConfig(), server_config.admission))
    server = OpenAIServer(server_config, engine, tokenizer, engine_config.model.model)
    runner = await start_http(server.build_app(), server_config.host, server_config.port)
    where = f" on cpus {format_cpus(server_config.cpus)}" if server_config.cpus else ""
    print(f"kvpush: serving {server.model_name} ({server_config.role.value}) on "
          f"http://{server_config.host}:{server_config.port}{where}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await runner.cleanup()
        await engine.shutdown()


def run_serve(engine_config: EngineConfig, server_config: ServerConfig,
              transfer_config: TransferConfig | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    apply_cpus(server_config.cpus)  # before any thread or the engine core starts: they inherit it
    asyncio.run(serve(engine_config, server_config, transfer_config))
