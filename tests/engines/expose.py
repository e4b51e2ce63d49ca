#!/usr/bin/env python3
"""Writes each serving engine's Prometheus exposition, as the engine's own
prometheus_client metric definitions produce it, before and after a known amount of
work: OUT/<engine>-0.prom and OUT/<engine>-1.prom. tests/all/engines.rs serves them to
tokwatt's external token source and checks the window against a hand computation.

Usage: expose.py OUT_DIR
"""

import os
import sys

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, enable_created_metrics,
                               generate_latest)

# A model name with the characters an exposition must escape or a naive parser splits on.
MODEL = 'org/llama "3", {8b}\\v2\nnew'

# vllm/v1/metrics/loggers.py (vLLM 0.11): per-engine series, labels model_name, engine.
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
# vllm/v1/metrics/loggers.py: time-to-first-token buckets.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
# sglang/srt/metrics/collector.py: inter-token latency buckets (its leading ones).
SGLANG_ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030,
                      0.035, 0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800,
                      1.0, 2.0]
# Triton's TensorRT-LLM backend: nv_llm_output_token_len buckets.
TRITON_TOKEN_BUCKETS = [10.0, 50.0, 100.0, 500.0, 1000.0]


def write(out_dir, name, registry):
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(generate_latest(registry))


def vllm(out_dir):
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                     labels, registry=registry)
    itl = Histogram("vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.", labels,
                    buckets=VLLM_ITL_BUCKETS, registry=registry)
    # Also present in a real vLLM 0.11 exposition, and similar to the deprecated name.
    Histogram("vllm:request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.", labels,
              buckets=VLLM_ITL_BUCKETS, registry=registry).labels(MODEL, "0").observe(0.02)
    prompts = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                      registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds",
                     "Histogram of time to first token in seconds.", labels,
                     buckets=VLLM_TTFT_BUCKETS, registry=registry)
    # Before: work that must not count in the window.
    tokens.labels(MODEL, "0").inc(100)
    for _ in range(10):
        itl.labels(MODEL, "0").observe(0.2)
    prompts.labels(MODEL, "0").inc(400)
    for _ in range(5):
        ttft.labels(MODEL, "0").observe(0.05)
    write(out_dir, "vllm-0.prom", registry)
    # The window: two engine cores.
    tokens.labels(MODEL, "0").inc(1000)
    tokens.labels(MODEL, "1").inc(500)
    for _ in range(80):
        itl.labels(MODEL, "0").observe(0.012)
    for _ in range(20):
        itl.labels(MODEL, "0").observe(0.03)
    for _ in range(100):
        itl.labels(MODEL, "1").observe(0.008)
    prompts.labels(MODEL, "0").inc(4096)
    prompts.labels(MODEL, "1").inc(2048)
    for _ in range(30):
        ttft.labels(MODEL, "0").observe(0.09)
    for _ in range(10):
        ttft.labels(MODEL, "1").observe(0.3)
    write(out_dir, "vllm-1.prom", registry)


def sglang(out_dir):
    registry = CollectorRegistry()
    labels = ["model_name"]
    tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                     labels, registry=registry)
    itl = Histogram("sglang:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.", labels,
                    buckets=SGLANG_ITL_BUCKETS, registry=registry)
    tokens.labels(MODEL).inc(7)
    write(out_dir, "sglang-0.prom", registry)
    tokens.labels(MODEL).inc(300)
    for _ in range(90):
        itl.labels(MODEL).observe(0.009)
    for _ in range(10):
        itl.labels(MODEL).observe(0.05)
    write(out_dir, "sglang-1.prom", registry)


def tgi(out_dir):
    registry = CollectorRegistry()
    generated = Histogram("tgi_request_generated_tokens", "Generated tokens per request",
                          buckets=[1, 10, 100, 1000], registry=registry)
    mean_tpot = Histogram("tgi_request_mean_time_per_token_duration",
                          "Mean time per token, per request (in seconds)",
                          buckets=[0.01, 0.05, 0.1, 0.5, 1.0], registry=registry)
    write(out_dir, "tgi-0.prom", registry)
    for tokens, tpot in [(200, 0.02), (300, 0.03), (100, 0.2), (400, 0.04)]:
        generated.observe(tokens)
        mean_tpot.observe(tpot)
    write(out_dir, "tgi-1.prom", registry)


def triton(out_dir):
    registry = CollectorRegistry()
    output_tokens = Histogram("nv_llm_output_token_len", "TRT LLM response metrics",
                              ["model", "version", "response_metric_type"],
                              buckets=TRITON_TOKEN_BUCKETS, registry=registry)
    series = output_tokens.labels("tensorrt_llm", "1", "total_output_tokens")
    series.observe(40)
    write(out_dir, "triton-0.prom", registry)
    for tokens in [120, 80]:
        series.observe(tokens)
    write(out_dir, "triton-1.prom", registry)


def llamacpp(out_dir):
    """llama.cpp's server (tools/server/server-context.cpp, `--metrics`), as it answered on
    the H200 (../shared/engines/llamacpp/llamacpp-metrics-h200.txt): one series per metric,
    no labels, no histogram. llama.cpp writes its text by hand; prometheus_client renders the
    same lines (counter families under their `_total` names) with two differences: values as
    floats (`96.0` for `96`), and `llamacpp:n_tokens_max`, which llama.cpp declares a counter
    without the `_total` suffix that prometheus_client always adds, is a gauge here. tokwatt
    reads neither of those. The `_created` series llama.cpp has not are switched off."""
    disable_created_metrics()
    registry = CollectorRegistry()

    def counter(name, help_text):
        return Counter("llamacpp:" + name, help_text, registry=registry)

    def gauge(name, help_text):
        return Gauge("llamacpp:" + name, help_text, registry=registry)

    prompt_tokens = counter("prompt_tokens",
                            "Number of prompt tokens processed, excluding cached tokens")
    cached = counter("prompt_tokens_cached", "Number of prompt tokens reused from the cache")
    prompt_seconds = counter("prompt_seconds", "Total time spent processing prompts")
    predicted = counter("tokens_predicted", "Number of generation tokens processed")
    predicted_seconds = counter("tokens_predicted_seconds", "Total time spent generating tokens")
    decodes = counter("n_decode", "Total number of llama_decode() calls, excluding speculative "
                      "decoding and multimodal decoding")
    tokens_max = gauge("n_tokens_max", "Largest observed sequence length (prompt + generation)")
    for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_drafts"):
        counter(name, "Speculative: " + name)
    prompt_rate = gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s")
    predicted_rate = gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s")
    processing = gauge("requests_processing", "Number of requests processing")
    gauge("requests_deferred", "Number of requests deferred")
    busy = gauge("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call")

    # Before: the two requests of the H200 probe, which must not count in the window.
    prompt_tokens.inc(9)
    cached.inc(1)
    prompt_seconds.inc(0.010535)
    predicted.inc(96)
    predicted_seconds.inc(0.116725)
    decodes.inc(96)
    tokens_max.set(70)
    prompt_rate.set(854.295)
    predicted_rate.set(805.312)
    busy.set(1)
    write(out_dir, "llamacpp-0.prom", registry)
    # The window: eight requests of 128 prompt and 256 predicted tokens, four at a time.
    prompt_tokens.inc(8 * 128)
    prompt_seconds.inc(0.4)
    predicted.inc(8 * 256)
    predicted_seconds.inc(3.1)
    decodes.inc(2 * 256)
    tokens_max.set(384)
    processing.set(4)
    busy.set(4)
    write(out_dir, "llamacpp-1.prom", registry)
    enable_created_metrics()


def main():
    out_dir = sys.argv[1]
    for engine in (vllm, sglang, tgi, triton, llamacpp):
        engine(out_dir)


if __name__ == "__main__":
    main()
