"""A request's trip through Redis, and submit-and-poll: queue it, follow its events to the end
(pub/sub plus its `tf:res` record), and /v1/requests to submit, poll, cancel and resume."""
