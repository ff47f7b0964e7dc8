"""The Responses API (/v1/responses), served on top of the chat path."""
