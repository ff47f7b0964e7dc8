"""What the tests and the benchmark scripts share, written once; the fleet never imports it
(the import-linter contract in pyproject.toml puts it above every product package).

- `checkpoints`: tiny random-weight checkpoints of every architecture we serve, and a tiny
  llama with SmolLM2's tokenizer;
- `random_models`: large random-weight models built on a device (Llama-3-8B's shape);
- `perplexity`: a text's perplexity under a loaded runner (what quantization costs);
- `workloads`: request lengths (ShareGPT-like or uniform) as prompt ids and output lengths;
- `roofline`: the hardware measured in the same run, and a workload's floors at its rates;
- `engine_runs`: an in-process engine warmed up and stepped over a workload;
- `processes`: child processes of a benchmark, on tokenfleet.supervise; CPU time; Redis;
- `redis_queue`: the request queue seen from outside, and a timestamping token-event listener;
- `sse`: server-sent events as a client reads them;
- `runs`: the command line, a timestamped log, percentiles, SIGTERM as an exception;
- `chaos/`: the chaos harness (scripts/chaos.py runs it, tests/test_chaos.py too).
"""
