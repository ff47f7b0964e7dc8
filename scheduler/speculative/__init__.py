"""Speculative decoding on the scheduler's side: who proposes drafts, and when a request speculates.

- proposers.py: the proposers' interface (`Proposer.propose(token_ids, max_drafts, req_id)`,
  `forget(req_id)`) and n-gram prompt lookup; EAGLE-style heads would be another proposer (they
  would need the target's hidden states from the workers).
- draft_model.py: a smaller model sharing the target's tokenizer, its own model runner and KV
  cache in the engine's process (the engine builds it and hands it to the Scheduler).
- speculator.py: which requests may speculate, how many drafts each gets, the per-request and
  per-step backoff (with an n-gram request's look-ups replayed on the host while it is off), and
  the counters the metrics read.
- gain.py: the expected-gain rule, a request's recent look-ups priced with the step cost model.

The verification is the workers' (workers/spec_verify.py); the scheduler's part of the step
(drafts in a decode's work, what is kept of them) is in scheduler.py.
"""
