"""What the tests and the benchmark scripts share, written once; the fleet never imports it
(the import-linter contract in pyproject.toml puts it above every product package).

- `checkpoints`: tiny random-weight checkpoints of every architecture we serve, and a tiny
  llama with SmolLM2's tokenizer;
- `random_models`: large random-weight models built on a device (Llama-3-8B's shape), and the
  GPU benchmarks' checkpoint (that shape with SmolLM2's vocabulary and tokenizer);
- `perplexity`: a text's perplexity under a loaded runner (what quantization costs);
- `workloads`: request lengths (ShareGPT-like or uniform) as prompt ids and output lengths;
- `roofline`: the hardware measured in the same run, and a workload's floors at its rates;
- `engine_runs`: an in-process engine warmed up and stepped over a workload;
- `hf_baseline`: the transformers baselines (static `generate`, batch-1 decode, continuous batching);
- `hf_agreement`: the engine's greedy tokens and logits against transformers' (gpu_check);
- `quant_linears`: every FP8 product candidate against bf16, one linear at a time;
- `grammar_probes`: timers on an in-process engine's grammar work;
- `processes`: child processes of a benchmark, on tokenfleet.supervise; a scheduler and a
  gateway started as deployed; CPU time, peak RSS; Redis;
- `redis_queue`: the request queue seen from outside, and a timestamping token-event listener;
- `sse`: server-sent events as a client reads them;
- `completion_streams`: streaming /v1/completions clients, every chunk timestamped;
- `chat_streams`: many streaming chat clients held open at once, each stream checked strictly;
- `added_latency`: what the gateway + pub/sub path adds per token, against a listener on Redis;
- what each script measures, the script keeping its command line and its table: `gpu_throughput`
  (bench_gpu), `gpu_profile` (profile_gpu), `structured_runs` (bench_structured), `prefix_cache_runs`
  (bench_prefix_cache), `pp_runs` (bench_pp), `batch_runs` (bench_batch), `mixed_runs`
  (bench_mixed_gpu), `gateway_streams` (bench_gateway), `autoscale_runs` (bench_autoscale),
  `routing_runs` (bench_routing), `routing_sim` (sim_routing), `dispatch_runs` (bench_dispatch),
  `host_loop` (bench_host_loop), `redis_shard_load` (bench_redis_shards), `multiturn_runs`
  (bench_kv_offload_gpu);
- `runs`: the command line, a timestamped log, percentiles, SIGTERM as an exception;
- `chaos/`: the chaos harness (scripts/chaos.py runs it, tests/test_chaos.py too).
"""
