"""The engine: one instance's requests from a prompt to their last token, over a paged KV cache.

    engine.py          the step loop's body: apply the connector's events, schedule, run, sample
    scheduler.py       which requests run this step (plain Python); block_manager.py: blocks and prefix cache
    request.py         one request and its states; sampling_params.py: how to sample, what sampling returns
    model_runner.py    a scheduled batch as tensors, the forward pass, sampling; compiler.py: torch.compile
    kv_connector.py    the interface a KV connector implements (kvpush/transfer has P's and D's) and
                       the hooks the engine gives it
    kv_cache.py        the block-major KV buffer; native_memory.py: huge pages and heap trimming
    admission.py       when an instance sheds a request (429); prompt_check.py: prompt bounds
    llm.py             the offline `LLM`; device.py: --device
    linear_choice.py   --linear-backend: MKL or oneDNN-packed linears, timed at start-up per CPU, cached
    attention_choice.py  --decode-attention / --prefill-attention: the C kernels or SDPA, likewise;
                       calibration.py: what the two choices share (alternating timing, the cache files)
"""
