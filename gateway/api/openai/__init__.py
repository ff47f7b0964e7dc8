"""The OpenAI API: /v1/chat/completions and /v1/completions, their request bodies, how a body
becomes queued work, and the response and chunk shapes a client reads back."""
