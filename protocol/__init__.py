"""What crosses a process boundary: Redis key names, stream messages, the result record, Lua.

Every process of the fleet (gateway, scheduler, workers, CLI) agrees through this package and
nothing else; it imports only value types and errors from `shared/`.
"""
