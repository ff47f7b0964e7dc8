"""The HTTP shell: the app factory and its resources (`app.py`), every route once (`routes.py`),
the middlewares (`middlewares.py`: request ids, errors in OpenAI's shape, API keys, access
logs), /openapi.json (`openapi.py`), one serving process (`server.py`) and the supervisor of
`--workers N` such processes on one port (`supervisor.py`)."""
