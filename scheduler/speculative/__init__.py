"""Speculative decoding on the scheduler's side: who proposes drafts, and when a request speculates.

- proposers.py: the proposers behind one interface (`Proposer.propose(token_ids, max_drafts)`);
  n-gram prompt lookup is built; a draft model or EAGLE-style heads would be other proposers
  (they would need the workers too: their own forward, or the target's hidden states).
- speculator.py: which requests may speculate, how many drafts each gets, the per-request and
  per-step backoff, and the counters the metrics read.

The verification is the workers' (workers/spec_verify.py); the scheduler's part of the step
(drafts in a decode's work, what is kept of them) is in scheduler.py.
"""
