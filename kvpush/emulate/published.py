"""Published measurements a GPU profile is held against, and the figure a profile predicts for them.

A closed-loop benchmark (`--max-concurrency C`, each client sends its next request when the last one
ends) with prompts of mean length I and outputs of mean length O, on an engine that schedules like
vLLM V1 (a new request's prefill joins the next step, beside the running decodes):

    d      = decode step of C sequences at their mean context I + O / 2
    m      = the step that prefills one prompt beside C - 1 decodes
    TPOT   = d + (C - 1) * (m - d) / (O - 1)     each other client's next prefill lands once in a request's
                                                 decode, stretching one step from d to m
    TTFT   = d / 2 + m + front_end_s            the new request waits half a step, then its own step

`front_end_s` is what the published TTFT holds beyond the accelerator (the server's HTTP, tokenizer,
chat template, scheduling and streaming): the profile records it (derivation.front_end_s) and the
emulator does not add it, because kvpush's own front end runs for real in an emulated instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.emulate.profile import StepClock


@dataclass(frozen=True)
class PublishedRun:
    name: str
    concurrency: int
    mean_input: float
    mean_output: float
    ttft_s: float  # mean
    tpot_s: float  # mean
    source: str


GPUSTACK_QWEN3_8B_H100 = PublishedRun(
    "Qwen3-8B, one H100 SXM, vLLM v0.11.0, ShareGPT, concurrency 4", 4, 23260 / 100, 22061 / 100, 64.00e-3,
    7.38e-3,
    "GPUStack performance lab, 'Optimizing Qwen3-8B Latency on NVIDIA H100 GPUs' (docs/performance-lab/qwen3-8b/"
    "h100-latency.md), vLLM baseline: vllm bench serve --dataset-name sharegpt --num-prompts 100 "
    "--max-concurrency 4; 23,260 input and 22,061 output tokens; mean TTFT 64.00 ms, mean TPOT 7.38 ms")


@dataclass(frozen=True)
class Predicted:
    decode_step_s: float
    prefill_step_s: float
    ttft_accelerator_s: float  # the TTFT without the front end
    tpot_s: float

    def ttft_s(self, front_end_s: float) -> float:
        return self.ttft_accelerator_s + front_end_s


def predict(clock: StepClock, run: PublishedRun) -> Predicted:
    """The closed-loop figures of `run` as `clock` prices its steps (the module docstring's model)."""
    c, prompt, out = run.concurrency, round(run.mean_input), run.mean_output
    context = round(run.mean_input + out / 2)
    d = clock.decode_time([context] * c)
    m = clock.step_time([(prompt, prompt)] + [(1, context)] * (c - 1))
    return Predicted(d, m, d / 2 + m, d + (c - 1) * (m - d) / (out - 1))
