"""Submit-and-poll: /v1/requests to submit, poll, cancel and resume a request by its id."""
