"""The HTTP front: ComfyUI's and A1111's APIs and the web page, as a thin client of the orchestrator daemon.

    python -m orchestrator.http --config run/pipeline.toml      # supervisord runs it: [program:http]

It holds no queue and decides nothing: a request is translated into the daemon's messages (SUBMIT, STATUS, CANCEL,
INFO over ipc://RUN/sock/orchestrator.sock) and the answer back into the API's shape. Modules: `settings` ([stage.http]
and the safety checks), `link` (the async daemon client), `tracker` (the daemon's jobs as events), `hub` (WebSocket
clients), `comfy` and `a1111` (the two APIs), `page` (the web page and its JSON), `files` (what /view may serve),
`app` (middlewares, routes, start-up).
Beside them, the vocabularies only this front speaks: ComfyUI's node table and graphs (`comfy_nodes`,
`comfy_graph`, `comfy_conditioning`, `comfy_workflow`, `comfy_png`), A1111's names and infotext (`a1111_names`,
`a1111_infotext`), and `png_formats` (the PNG formats the ways in hand the engine). See docs/http.md.
"""
